"""Near misses on the command line (`clip=tigth`, `trainer.step=3`): one line with "did you mean", before Hydra.

Hydra's own answer to an unknown group option is a multi-line MissingConfigException (raised in
hydra/_internal/defaults_list.py:799, `config_not_found_error`) that its `run_and_report`
(hydra/_internal/utils.py:218, exit at :303; Hydra 1.3.8) prints with the option list and the
config search path, then exits 1: by then the app cannot add a suggestion. So the command line is
checked here first, with Hydra's own override parser (sweeps such as `clip=tigth,loose` included)
and Hydra's own list of a group's options (its config loader, so every search path entry counts);
anything this cannot judge is left to Hydra.
"""

from __future__ import annotations

import difflib
import shlex

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, ValueType
from hydra.errors import HydraException

from src.validate.schema import group_defaults
from src.paths import CONFIG_DIR
from src.validate.schema import SchemaError, check_override_keys, foreign_name, known_keys

# Sweep values that name options one by one (a range or a glob is Hydra's to expand and judge).
LISTED_VALUES = (ValueType.ELEMENT, ValueType.SIMPLE_CHOICE_SWEEP, ValueType.CHOICE_SWEEP)
# What a group's options share (conf/policy/base.yaml, conf/trainer/base.yaml): included by them, never chosen.
SHARED = "base"


def close_matches(word: str, choices: list[str]) -> list[str]:
    """The choices that look like a misspelling or a shortening of `word`, best first (at most three)."""
    close = difflib.get_close_matches(word, choices, n=3, cutoff=0.6)
    return (close + [choice for choice in choices if choice.startswith(word) and choice not in close])[:3]


def did_you_mean(key: str, candidates: list[str]) -> str:
    """` (did you mean key=a or key=b?)`, or nothing when no candidate is close."""
    return f" (did you mean {' or '.join(f'{key}={c}' for c in candidates)}?)" if candidates else ""


def overrides_of(argv: list[str]) -> list[Override]:
    """The command line's overrides as Hydra parses them; flags and what Hydra would refuse anyway are skipped."""
    parser = OverridesParser.create()
    parsed = []
    for word in argv:
        if "=" not in word or word.startswith("-"):
            continue  # a flag (-m, --cfg job) or its value
        try:
            parsed.extend(parser.parse_overrides([word]))
        except HydraException:
            continue  # a syntax error: Hydra's own message names it
    return parsed


def parse_problem(word: str) -> str | None:
    """Why Hydra's override grammar cannot read `word`, with the quoting that can; None if it can.

    Hydra's lexer (hydra/core/override_parser/overrides_parser.py) reads `~` only as a deletion at the start
    of a key, and no `#`, `;`, `&`, `!`, `<`, quote or unmatched bracket in a bare value."""
    if "=" not in word or word.startswith("-"):
        return None
    try:
        OverridesParser.create().parse_overrides([word])
        return None
    except HydraException as error:
        lines = str(error).splitlines()
    key, value = word.split("=", 1)
    caret = lines[1].find("^") - len("LexerNoViableAltException: ") if len(lines) > 1 and "^" in lines[1] else -1
    what = f"'{word[caret]}' in its value" if 0 <= caret < len(word) else f"it ({lines[0]})"
    quoted = shlex.quote(f'{key}="{value}"') if '"' not in value else shlex.quote(f"{key}='{value}'")
    home = f", or write {key}=$HOME/{value[2:]} (the shell expands $HOME)" if value.startswith("~/") else ""
    return (f"{word}: Hydra's override grammar cannot read {what}; quote the value for Hydra, and the whole word "
            f"for the shell: {quoted}{home}")


def check_syntax(argv: list[str]) -> None:
    """Raise SchemaError for the first override Hydra's grammar cannot read (Hydra's own answer is a lexer
    error of three lines that names neither the fix nor the quoting that works)."""
    for word in argv:
        problem = parse_problem(word)
        if problem:
            raise SchemaError(problem)


def check_given_once(argv: list[str]) -> None:
    """Raise SchemaError for a key set twice to different values: Hydra keeps the last without a word, so
    `trainer.steps=5 trainer.steps=6` would train 6 steps."""
    seen: dict[str, str] = {}
    for override in overrides_of(argv):
        if override.is_delete():
            continue
        key, value = override.get_key_element(), override.input_line.split("=", 1)[1]
        if key in seen and seen[key] != value:
            raise SchemaError(f"{key} is given twice ({key}={seen[key]} and {key}={value}): Hydra would use the "
                              f"last alone; keep the one you mean")
        seen[key] = value


def named_values(override: Override) -> list[str]:
    """The option names an override asks for: one, or each of a sweep's choices."""
    if override.value_type not in LISTED_VALUES:
        return []
    values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
    return [value for value in values if isinstance(value, str)]


def group_choice_problem(override: Override, groups: list[str], options_of, added: list[str]) -> str | None:
    """Why a `group=option` override names no existing option (or no existing group), with the close matches.
    `added`: the groups that are not in the config's defaults list (chosen with `+`)."""
    group = override.key_or_group
    if override.is_delete() or "." in group:
        return None
    options = options_of(group)
    if not options:
        return unknown_name_problem(override, groups, options_of)
    key = ("+" if override.is_add() else "") + group
    for value in named_values(override):
        if value == SHARED and SHARED in options:
            return (f"{override.input_line}: conf/{group}/{SHARED}.yaml is what every {group} option shares, not "
                    f"one to choose; choose one of {', '.join(choosable(options))}")
        if value not in options:
            return (f"{override.input_line}: {group} has no option '{value}'"
                    f"{did_you_mean(key, close_matches(value, choosable(options)))}; its options: "
                    f"{', '.join(choosable(options))}")
    if group in added and not override.is_add():
        return (f"{override.input_line}: {group} is not chosen by default, so a choice of it is added with +: "
                f"+{override.input_line}")
    return None


def choosable(options: list[str]) -> list[str]:
    return [option for option in options if option != SHARED]


def unknown_name_problem(override: Override, groups: list[str], options_of) -> str | None:
    """`model=qwen2.5-0.5b`, `num_generations=8`, `clp=tight`: a top-level name that is neither a group nor a
    key. The group that has the value as an option, the key another trainer's name stands for, or the close
    group names; None for a group or key that exists (or an addition no group explains: src.validate.schema judges it)."""
    group, line = override.key_or_group, override.input_line
    if group in groups or group in {key.split(".", 1)[0] for key in known_keys()}:
        return None
    close = [] if override.is_add() else close_matches(group, groups)
    if close:
        return (f"{line}: there is no config group '{group}' (did you mean "
                f"{' or '.join(f'{name}=' for name in close)}...?); `python -m src.run --help` lists the groups")
    values = named_values(override)
    having = [name for name in groups if "/" not in name and values and set(values) <= set(choosable(options_of(name)))]
    if having:
        shown = override.input_line.split("=", 1)[1]
        return (f"{line}: there is no config group or key '{group}'; {shown} is an option of "
                f"{' and '.join(having)} (did you mean {' or '.join(f'{name}={shown}' for name in having)}?)")
    foreign = foreign_name(group)
    if foreign:
        return (f"{line}: unknown key; this project calls it {foreign[0]} ({group}: {foreign[1]}), e.g. "
                f"{foreign[0]}={line.split('=', 1)[1]}")
    if override.is_add():
        return None
    return (f"{line}: there is no config group or top-level key '{group}'; a knob is set as group.key=value "
            "(`python -m src.run --cfg job` lists them), a group's option as group=option (`--help` lists them)")


def check_group_choices(argv: list[str]) -> None:
    """Raise SchemaError for the first override that picks an option (or a group) that does not exist.

    A `hydra.searchpath=[...]` override anywhere on the line adds its folders' options, as Hydra's config loader
    reads them when it composes (hydra/_internal/config_loader_impl.py:152, `_process_config_searchpath`)."""
    overrides = overrides_of(argv)
    if not overrides:
        return
    searchpath = [override.input_line for override in overrides if override.get_key_element() == "hydra.searchpath"]
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()

        def options_of(group: str, kind: ObjectType = ObjectType.CONFIG) -> list[str]:
            return loader.get_group_options(group, kind, config_name="config", overrides=searchpath)

        groups = options_of("", ObjectType.GROUP)
        added = [] if any(override.is_add() and override.key_or_group in groups for override in overrides) else \
            [group for group in groups if "/" not in group and group not in group_defaults() and group != "hydra"]
        for override in overrides:
            problem = group_choice_problem(override, groups, options_of, added)
            if problem:
                raise SchemaError(problem)


def check_knob_keys(argv: list[str]) -> None:
    """`src.validate.schema`'s unknown-key check, its message naming the whole override (the value too)."""
    for word in argv:
        try:
            check_override_keys([word], argv)  # one word at a time, the search path from the whole line
        except SchemaError as error:
            key = word.split("=", 1)[0]
            message = str(error)
            raise SchemaError(word + message[len(key):] if message.startswith(key + ":") else message) from None


def check_command_line(argv: list[str]) -> None:
    """Every near miss on a `python -m src.run` command line, as one SchemaError message; nothing is composed."""
    check_syntax(argv)
    check_given_once(argv)
    check_knob_keys(argv)
    check_group_choices(argv)
