"""`python -m src.eval`'s command line, read before torch and MLflow load: `--help`, `--version`, and a policy,
checkpoint, store or sweep that does not exist, each answered in one line (src/command/entry.py).

    python -m src.eval --run 1ab4cbe5... evaluation=probe          # add a probe to one finished run
    python -m src.eval --sweep ratio evaluation=canonical           # every finished run of a study
    python -m src.eval --checkpoint outputs/.../checkpoint.pt       # a mid-run checkpoint (a learning-curve point)
    python -m src.eval --policy checkpoints/tiny-countdown evaluation=canonical   # any folder; prints only

Trailing arguments are Hydra overrides of the evaluation, hardware and tracking groups
(`evaluation.repeats=2`, `hardware=h100`, `tracking.uri=...`). The task and policy settings
come from the evaluated run's own `config.yaml`, so the held-out prompts are exactly the ones
that run trained against. A run that already holds this protocol's results is skipped unless
`--force`. Results go to the run through the MLflow client, so a failed evaluation never
changes a finished run's status.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m src.eval", description=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_argument_group("what to evaluate (at least one)")
    target.add_argument("--run", action="append", default=[], help="MLflow run id (repeatable)")
    target.add_argument("--sweep", action="append", default=[], help="every FINISHED run tagged with this sweep")
    target.add_argument("--checkpoint", type=Path, help="a training checkpoint.pt (logged into its own run)")
    target.add_argument("--policy", help="a saved policy folder or hub name (results printed and written as CSV)")
    parser.add_argument("--force", action="store_true", help="evaluate again even if the run has these results")
    parser.add_argument("--out", type=Path, help="where --policy writes its CSV tables (default: <out>/outputs/evaluations, "
                                                 "the `out` key's folder)")
    parser.add_argument("--version", action="store_true", help="print the project's version and exit")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. evaluation=probe evaluation.repeats=2")
    return parser


def check_before_imports(argv: list[str]) -> None:
    """Exit with one line for what `argv` names that is not there; return quietly otherwise (`--help` and
    `--version` answered and exited here too)."""
    from src.command.entry import answer_version, check_checkpoint, check_policy, check_store, refuse_on_error, \
        tracking_settings

    answer_version(argv, "python -m src.eval")
    parser = argument_parser()
    args = parser.parse_args(argv)
    if not (args.run or args.sweep or args.checkpoint or args.policy):
        parser.error("name what to evaluate: --run RUN_ID, --sweep NAME, --checkpoint PATH or --policy PATH")
    if args.policy:
        refuse_on_error(check_policy, args.policy)
    if args.checkpoint:
        refuse_on_error(check_checkpoint, str(args.checkpoint))
    if args.run or args.sweep:
        refuse_on_error(lambda: check_store(*tracking_settings(args.overrides)[:2], args.sweep))
