"""How long `python -m src.run` takes to refuse a config mistake, measured as a user meets it.

    python -m benchmarks.first_answer               # each mistake 3 times: its median wall time
    python -m benchmarks.first_answer --repeats 1

Each mistake runs as a fresh process from the project folder (Python start-up, the check, the one-line message),
with its MLflow store and run folder in a temporary folder that must stay empty. The target: under 2 s on an idle
2-core machine, because the checks run before torch, transformers and MLflow are imported (src/command/cli.py). A figure
includes the machine's load: the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from src.paths import PROJECT_ROOT

# (what the user got wrong, the words after `python -m src.run`)
MISTAKES = [
    ("a typo in a group option", ["clip=tigth"]),
    ("an unknown key", ["trainer.stepz=3"]),
    ("a value out of range", ["trainer.steps=0"]),
    ("a component knob out of range", ["buffer=age2", "buffer.ratio=-1"]),
    ("a setting the option does not use", ["buffer=none", "buffer.max_age=2"]),
    ("a setting only other options have", ["loss.eps_low=0.2"]),
    ("a policy folder that does not exist", ["policy.name_or_path=checkpoints/tiny-countdwn"]),
    ("a hub name the hub cannot serve", ["policy.name_or_path=Qwen/Qwen2.5-0.5X"]),
    ("a study without -m", ["+sweep=ratio", "hydra.sweeper.dry_run=true"]),
]


def answer_seconds(argv: list[str], folder: Path) -> tuple[float, int, str]:
    """Wall seconds of one refused command, its exit status and its last line."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "src.run", *argv, f"tracking.uri=sqlite:///{folder}/m.db",
                           f"hydra.run.dir={folder}/run"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "400"})
    seconds = time.perf_counter() - started
    lines = (done.stdout + done.stderr).strip().splitlines()
    return seconds, done.returncode, lines[-1] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
    print("| mistake | command | median s | exit |\n| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as folder:
        for what, argv in MISTAKES:
            timings = [answer_seconds(argv, Path(folder)) for _ in range(repeats)]
            median = statistics.median(seconds for seconds, _, _ in timings)
            print(f"| {what} | `python -m src.run {' '.join(argv)}` | {median:.2f} | {timings[-1][1]} |", flush=True)
        if any(Path(folder).iterdir()):
            sys.exit(f"a refused command wrote to its MLflow store: {sorted(os.listdir(folder))}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
