"""Argument checks shared by components that validate their own settings, and the one-line exit for a
command line that fails them.

A component names each setting by its config key (`buffer.capacity`), so the message `src.command.config`
shows for a bad value is the constructor's own.
"""

from __future__ import annotations

import sys


def check_int(name: str, value: object, minimum: int, hint: str = "") -> int:
    """Return `value` as an int, or raise a ValueError naming `name` if it is not an integer >= `minimum`."""
    # bool is an int subclass; a flag passed where a number belongs is a config mistake.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}.{(' ' + hint) if hint else ''}")
    return int(value)


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """Return `value`, or raise a ValueError naming `name`, the value and the choices if it is not one of them."""
    if value not in choices:
        raise ValueError(f"{name}={value!r}: {name.rsplit('.', 1)[-1]} must be one of {', '.join(choices)}")
    return value


def composition_error(error: Exception, overrides: list[str]) -> str:
    """Hydra's composition message (an unknown option or key) on one line, without its config search path."""
    lines = [line.strip() for line in str(error).split("Config search path:")[0].splitlines() if line.strip()]
    text = lines[0] + ("" if len(lines) == 1 else f" {lines[1]} " + ", ".join(lines[2:])) if lines else repr(error)
    options, missing = getattr(error, "options", None), getattr(error, "missing_cfg_file", None) or ""
    if options and "/" in missing:  # Hydra's MissingConfigException for an unknown group option
        from src.validate.suggest import close_matches, did_you_mean

        group, _, option = missing.rpartition("/")
        text += did_you_mean(group, close_matches(option, [name for name in options if name != "base"]))
    return f"{' '.join(overrides)}: {text.strip()}"


def exit_with_message(error: Exception, status: int = 2) -> None:
    """One line naming the problem and its fix, exit status 2 (1: the machine, not the command), no traceback."""
    from rich.console import Console

    Console(stderr=True).print(f"[bold red]error:[/bold red] {error}", soft_wrap=True, highlight=False)
    sys.exit(status)
