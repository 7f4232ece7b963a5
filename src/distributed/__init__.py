"""Data-parallel training over T ranks (FSDP2): the objective sees the other ranks only through a `Reducer`."""
