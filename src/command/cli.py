"""The command line of `python -m src.run` (and `replay-rloo`): help, then every check that needs no model library,
then Hydra and the training in `src.run`.

A mistake on the command line (a mistyped option or key, a value out of range, a setting the chosen option does not
use, a policy folder that does not exist) is one line and exit 2 within a second or two: this module and what it
imports load no torch, transformers or MLflow (`tests/commands/test_cli.py` checks; `python -m benchmarks.first_answer`
times it). `src.run` imports them only after these checks pass, and `src.command.config.validate` checks the whole config
again there, with every component class loaded.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import sys

from src.validate.checks import exit_with_message

MULTIRUN = ("-m", "--multirun")
# Flags after which Hydra runs no job (it prints something, or hands over to another program).
NO_JOB = ("--cfg", "-c", "--info", "-i", "--hydra-help", "--shell-completion", "-sc", "--experimental-rerun")
# Flags that change where Hydra reads the config: what it composes then is Hydra's to judge.
OTHER_CONFIG = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


class CommandLineError(ValueError):
    """A command line that cannot mean what its user wants; the message says what to type instead."""


def hydra_order(argv: list[str]) -> list[str]:
    """`argv` with its flags first and its overrides after them, in their order.

    Hydra reads its command line with argparse, whose `nargs="*"` overrides must stand in one run
    (hydra/_internal/utils.py:513): `trainer.steps=2 -m buffer=age1` would be refused as unrecognized
    arguments. Hydra's own parser, reading intermixed arguments, tells flags and overrides apart here.
    """
    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # a flag Hydra refuses: its own message comes later
            overrides = list(get_args_parser().parse_intermixed_args(argv).overrides)
    except SystemExit:
        return argv
    flags, pending = [], list(overrides)
    for word in argv:
        if pending and word == pending[0]:
            pending.pop(0)
        else:
            flags.append(word)
    return flags + overrides


def is_multirun(argv: list[str]) -> bool:
    """`-m`, `--multirun`, or Hydra's own `hydra.mode=MULTIRUN`."""
    return any(word in MULTIRUN or word.replace(" ", "") == "hydra.mode=MULTIRUN" for word in argv)


def check_multirun(argv: list[str]) -> None:
    """A study (`+sweep=ratio`, `+reproduce=seed000`: an option that sets the sweeper's grid) or a sweeper setting
    without `-m` would train the default cell alone: refuse it."""
    if is_multirun(argv) or any(word in NO_JOB for word in argv):
        return
    for word in argv:
        key = word.split("=", 1)[0].lstrip("+~")
        if "=" in word and (key.startswith(("hydra.sweeper.", "sweep.")) or sets_a_grid(key, word.split("=", 1)[1])):
            refuse_without_multirun(word, argv)


def refuse_without_multirun(word: str, argv: list[str]) -> None:
    """Raise CommandLineError with the command to type: `-m`, and `+` before a group chosen by adding it."""
    from src.validate.schema import group_defaults
    from src.paths import CONFIG_DIR

    def added(each: str) -> str:
        group = each.split("=", 1)[0]
        return "+" + each if "=" in each and (CONFIG_DIR / group).is_dir() and group not in group_defaults() else each

    raise CommandLineError(f"{word} belongs to a sweep, which runs with -m; without it one default cell would "
                           f"train. Run: python -m src.run -m {shlex.join(added(each) for each in argv)}")


def sets_a_grid(group: str, option: str) -> bool:
    """Whether conf/<group>/<option>.yaml is a study: every `sweep` option, and a `reproduce` option that sets the
    sweeper's grid. An `experiment` preset also carries its study's grid, but without -m it is one cell of it
    (its header names that cell), so it is not refused."""
    import yaml

    from src.paths import CONFIG_DIR

    path = CONFIG_DIR / group / f"{option}.yaml"
    if group == "sweep":
        return True
    if group != "reproduce" or not path.is_file():
        return False
    node = yaml.safe_load(path.read_text()) or {}
    return isinstance(node.get("hydra"), dict) and "sweeper" in node["hydra"]


def single_run(argv: list[str]) -> bool:
    """Whether this command line trains one cell from conf/ (no -m, no flag that prints or reads another config)."""
    return not is_multirun(argv) and not any(word.split("=", 1)[0] in NO_JOB + OTHER_CONFIG for word in argv)


def check_config(overrides: list[str]) -> None:
    """Compose the one cell's config as Hydra will and run the checks that need no model library
    (`src.command.config.check_before_imports`); a config Hydra itself cannot compose is left to Hydra's message."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from src.command.config import check_before_imports
    from src.paths import CONFIG_DIR

    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3", job_name="run"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as error:
        # Hydra raises ConfigCompositionException from OmegaConf's error, which names the key it could not set.
        check_setting_of_other_options(getattr(error.__cause__, "full_key", None), overrides)
        from src.validate.checks import composition_error

        raise CommandLineError(composition_error(error, overrides)) from None
    # An experiment preset brings its study's grid (+experiment=seed000-countdown: its defaults add /sweep: paper),
    # yet without -m it is one cell of it, as each preset's header shows; `check_multirun` refuses the studies.
    check_before_imports(cfg, overrides)


def check_setting_of_other_options(key: str | None, overrides: list[str]) -> None:
    """`loss.eps_low=0.2` under loss=rloo: a key the chosen option's YAML does not have, so the setting would
    change nothing (Hydra's own answer suggests adding it with `+`). Raise CommandLineError naming the options
    that have it; a key no option has is left to the unknown-key check and Hydra."""
    import yaml

    from src.paths import CONFIG_DIR, searchpath_folders
    from src.validate.schema import _leaves

    word = next((word for word in overrides if key and word.split("=", 1)[0] == key), None)
    if word is None or key.count(".") < 1:
        return
    group, name = key.split(".", 1)
    having = sorted({path.stem for root in (CONFIG_DIR, *searchpath_folders(overrides))
                     for path in (root / group).glob("*.yaml")
                     if path.stem != "base" and name in _leaves(yaml.safe_load(path.read_text()) or {})})
    if having:
        from src.validate.schema import group_defaults  # the default option (another option may pick a different one)

        chosen = next((w.split("=", 1)[1] for w in overrides if w.split("=", 1)[0] == group), None)
        chosen = chosen or group_defaults().get(group, "?")
        raise CommandLineError(f"{word}: {group}={chosen} has no setting {name}, so it would change nothing; "
                               f"pick a {group} that has it ({', '.join(f'{group}={stem}' for stem in having)}), "
                               f"or drop {key}")


def check(argv: list[str]) -> list[str]:
    """The command line in Hydra's order, once every check before the model libraries passed; raises what they
    raise (CommandLineError, src.validate.schema.SchemaError, src.command.config.ConfigError), each one line."""
    from src.validate.suggest import check_command_line

    argv = hydra_order(argv)
    check_multirun(argv)
    check_command_line(argv)  # near misses: one line with "did you mean", before Hydra composes
    if single_run(argv):
        check_config(argv)
    return argv


def cli() -> bool:
    """`python -m src.run ...` before the model libraries load: `--help` answered (False), or the checks above
    passed and `sys.argv` put in Hydra's order (True); a mistake exits here with its one line."""
    from src.help import help_text, wants_help, wants_version
    from src.paths import project_version

    if wants_version(sys.argv[1:]):
        sys.stdout.write(f"replay-rloo {project_version()}\n")
        return False
    if wants_help(sys.argv[1:]):
        sys.stdout.write(help_text())
        return False
    from src.command.config import ConfigError
    from src.validate.schema import SchemaError

    try:
        sys.argv[1:] = check(sys.argv[1:])
    except (CommandLineError, SchemaError, ConfigError) as error:
        exit_with_message(error)
    return True


def main() -> None:
    """`replay-rloo ...`, the installed command: `python -m src.run ...` under its own name (Hydra's shell
    completion names the command it completes)."""
    import runpy

    runpy.run_module("src.run", run_name="__main__")
