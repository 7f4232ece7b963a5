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

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, ValueType
from hydra.errors import HydraException

from src.paths import CONFIG_DIR
from src.schema import SchemaError, check_override_keys

# Sweep values that name options one by one (a range or a glob is Hydra's to expand and judge).
LISTED_VALUES = (ValueType.ELEMENT, ValueType.SIMPLE_CHOICE_SWEEP, ValueType.CHOICE_SWEEP)


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


def named_values(override: Override) -> list[str]:
    """The option names an override asks for: one, or each of a sweep's choices."""
    if override.value_type not in LISTED_VALUES:
        return []
    values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
    return [value for value in values if isinstance(value, str)]


def group_choice_problem(override: Override, groups: list[str], options_of) -> str | None:
    """Why a `group=option` override names no existing option (or no existing group), with the close matches."""
    group = override.key_or_group
    if override.is_delete() or "." in group:
        return None
    options = options_of(group)
    if not options:  # not a group: a close group name is the likely meaning (`clp=tight`)
        if group in groups or override.is_add():
            return None
        close = close_matches(group, groups)
        if not close:
            return None  # a top-level key, or something Hydra explains
        return (f"{override.input_line}: there is no config group '{group}' (did you mean "
                f"{' or '.join(f'{name}=' for name in close)}...?); `python -m src.run --help` lists the groups")
    for value in named_values(override):
        if value not in options:
            key = ("+" if override.is_add() else "") + group
            return (f"{override.input_line}: {group} has no option '{value}'"
                    f"{did_you_mean(key, close_matches(value, options))}; its options: {', '.join(options)}")
    return None


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
        for override in overrides:
            problem = group_choice_problem(override, groups, options_of)
            if problem:
                raise SchemaError(problem)


def check_knob_keys(argv: list[str]) -> None:
    """`src.schema`'s unknown-key check, its message naming the whole override (the value too)."""
    for word in argv:
        try:
            check_override_keys([word])
        except SchemaError as error:
            key = word.split("=", 1)[0]
            message = str(error)
            raise SchemaError(word + message[len(key):] if message.startswith(key + ":") else message) from None


def check_command_line(argv: list[str]) -> None:
    """Every near miss on a `python -m src.run` command line, as one SchemaError message; nothing is composed."""
    check_knob_keys(argv)
    check_group_choices(argv)
