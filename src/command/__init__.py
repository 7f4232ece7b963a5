"""The command wing: the command lines of `python -m src.run` and the other entry points, answered before any
heavy import (help, version, a bad key or value, a missing store), and the whole config's checks."""
