"""The installed `replay-rloo-report`: `python -m analysis.report` as that module runs, its command line
checked before MLflow loads (src/command/entry.py, `run_as_module`)."""

from src.command.entry import run_as_module


def report() -> None:
    run_as_module("analysis.report")
