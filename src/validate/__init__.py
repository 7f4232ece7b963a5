"""The validate wing: every knob's type and range (schema), the argument checks components make of their own
settings (checks), and the near misses a refused name gets (suggest): one line each, before any compute."""
