"""What every command-line entry point answers before it imports its heavy libraries (torch, transformers, MLflow,
pandas): `--version`, and a policy, checkpoint, MLflow store, experiment or sweep that does not exist, each as
one line naming the fix and exit 2, in about a second (`src.run`'s own command line: src/command/cli.py).

The store is read with the standard library's sqlite3 (read-only, never created): MLflow's client would create
an empty store where none was, and take seconds to import. A tracking server is left to the command's own
check (`src.runs.store.check_store`), which answers in seconds too.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

from src.validate.checks import exit_with_message

STORE_FIX = ("train there first (make demo, make sweep-NAME, python -m src.run), or point out=DIR (or "
             "tracking.uri=sqlite:///DIR/mlruns.db) at the folder that holds the runs")


class EntryError(ValueError):
    """A command line naming something that is not there; the message says what to type instead. `status`: 2 for
    a mistake on the command line, 1 for a store that holds nothing to read (as the commands answer after MLflow)."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


def run_as_module(name: str) -> None:
    """An installed command runs `python -m name` as that module runs: its command line checked before it
    imports torch or MLflow (the checks stand in the module's `__main__` part, which a plain import skips)."""
    import runpy

    runpy.run_module(name, run_name="__main__", alter_sys=True)


def evaluate_command() -> None:
    """`replay-rloo-evaluate`, the installed `python -m src.eval`."""
    run_as_module("src.eval")


def answer_version(argv: list[str], program: str) -> None:
    """`--version`: the project's version from its package metadata, then exit 0."""
    if "--version" in argv:
        from src.paths import project_version

        sys.stdout.write(f"{program} (replay-rloo) {project_version()}\n")
        sys.exit(0)


def refuse_on_error(check, *args) -> None:
    """Run `check(*args)`; an EntryError, or a config mistake in the overrides, exits with its one line."""
    from src.command.cli import CommandLineError
    from src.validate.schema import SchemaError

    try:
        check(*args)
    except (EntryError, CommandLineError, SchemaError) as error:
        exit_with_message(error, getattr(error, "status", 2))


def tracking_settings(overrides: list[str]) -> tuple[str, str, str]:
    """(tracking.uri, tracking.experiment, out) as the overrides compose them; a mistake in them is one line."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from src.validate.checks import composition_error
    from src.paths import CONFIG_DIR, register_root_resolver
    from src.validate.suggest import check_command_line

    register_root_resolver()
    check_command_line(overrides)  # near misses, Hydra's lexer errors, a key given twice
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            composed = compose("config", overrides=overrides)
        return str(composed.tracking.uri), str(composed.tracking.experiment), str(composed.out)
    except (HydraException, OmegaConfBaseException) as error:
        raise EntryError(composition_error(error, overrides)) from None


def check_runs_there(overrides: list[str], sweeps: list[str] = (), experiment: str | None = None,
                     hint: str = "") -> None:
    """An analysis command's store, experiment (its `--experiment`, else tracking.experiment) and sweeps, as its
    overrides name them: exit with one line when one is not there (`hint`: what trains the missing runs)."""
    def check() -> None:
        uri, configured, _ = tracking_settings(overrides)
        try:
            check_store(uri, experiment or configured, list(sweeps or ()))
        except EntryError as error:
            raise EntryError(f"{error}; {hint}" if hint else str(error), error.status) from None

    refuse_on_error(check)


def sqlite_file(uri: str) -> Path | None:
    """The file of a `sqlite:///` store URI; None for any other store (a tracking server)."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def check_store(uri: str, experiment: str, sweeps: list[str] = ()) -> None:
    """Raise EntryError when a SQLite store does not exist, lacks the experiment, or holds no run of a sweep."""
    path = sqlite_file(uri)
    if path is None:
        return
    if not path.is_file():
        raise EntryError(f"no MLflow store at {uri} (no file {path}: nothing has run there yet); {STORE_FIX}", 1)
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as store:
            names = [row[0] for row in store.execute("SELECT name FROM experiments WHERE lifecycle_stage='active'")]
            counts = dict(store.execute(
                "SELECT t.value, COUNT(DISTINCT r.run_uuid) FROM tags t JOIN runs r ON r.run_uuid = t.run_uuid "
                "JOIN experiments e ON e.experiment_id = r.experiment_id WHERE t.key = 'sweep' AND e.name = ? AND "
                "r.lifecycle_stage = 'active' GROUP BY t.value", (experiment,)))
            listed = [row[0] for row in store.execute(
                "SELECT t.value FROM tags t JOIN runs r ON r.run_uuid = t.run_uuid JOIN experiments e ON "
                "e.experiment_id = r.experiment_id WHERE t.key = 'sweeps' AND e.name = ?", (experiment,))]
    except sqlite3.Error:
        return  # not a store this can read: MLflow's own client says what it is
    if experiment not in names:
        raise EntryError(f"experiment '{experiment}' not found at {uri} (experiments there: {', '.join(names) or 'none'}"
                         f"); name one with tracking.experiment=NAME, or {STORE_FIX}", 1)
    for names_of_run in listed:  # a run shared by several studies names them all in its `sweeps` tag
        for name in {name for name in names_of_run.split(",") if name}:
            counts.setdefault(name, 0)
    for sweep in sweeps:
        if sweep not in counts:
            raise EntryError(f"no runs found in experiment '{experiment}' at {uri} with sweep '{sweep}'"
                             f"{sweep_hint(sweep, counts)}", 1)


def sweep_hint(sweep: str, counts: dict[str, int]) -> str:
    """` (did you mean ratio?); the sweeps there: ...`, or what to run when the experiment holds no sweep."""
    import difflib

    if not counts:
        return "; it holds no sweep's runs yet: make sweep-NAME (python -m src.run -m +sweep=NAME) or make demo trains one"
    close = difflib.get_close_matches(sweep, list(counts), n=2, cutoff=0.6)
    listed = ", ".join(f"{name} ({count} run{'s' if count != 1 else ''})" for name, count in sorted(counts.items()))
    return (f" (did you mean {' or '.join(close)}?)" if close else "") + f"; the sweeps there: {listed}"


def check_policy(name: str, key: str = "--policy") -> None:
    """Raise EntryError for a policy folder that does not exist or a hub name neither cached nor on the hub
    (`src.command.config`'s check, the one `src.run` makes, in the words of this command's option)."""
    from src.command.config import ConfigError, validate_policy_files

    try:
        validate_policy_files(name, key=key)
    except ConfigError as error:
        raise EntryError(str(error)) from None


def check_checkpoint(path: str) -> None:
    if not Path(path).is_file():
        raise EntryError(f"--checkpoint {path}: no such file; runs write checkpoint.pt into their output folder "
                         "(the run's `output_dir` tag in MLflow)")
