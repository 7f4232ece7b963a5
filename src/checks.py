"""Argument checks shared by components that validate their own settings."""

from __future__ import annotations


def check_int(name: str, value: object, minimum: int, hint: str = "") -> int:
    """Return `value` as an int, or raise a ValueError naming `name` if it is not an integer >= `minimum`."""
    # bool is an int subclass; a flag passed where a number belongs is a config mistake.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.{(' ' + hint) if hint else ''}")
    return int(value)
