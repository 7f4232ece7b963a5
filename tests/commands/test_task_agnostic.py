"""The replay store and the pass@k metrics know no task: "correct" and the answer extractor come from the task
(`Task.correct_reward`, `Task.extract`), handed in by `src.build` and the evaluation protocol."""

from __future__ import annotations

import subprocess
import sys

import pytest

from src.settings import RunSettings
from src.paths import PROJECT_ROOT

AGNOSTIC = ("src.buffer.fifo", "src.buffer.positive_bias", "src.passk")


@pytest.mark.parametrize("module", AGNOSTIC)
def test_the_module_loads_no_task(module):
    """In a fresh interpreter, so no other test's imports hide one: no src.task module comes in with it."""
    probe = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('src.task')))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_the_fifo_store_is_told_what_the_task_counts_as_correct(compose_config):
    from src.build import build_store
    from src.task.base import build_task

    cfg = compose_config("buffer=fifo", "buffer.positive_bias=0.5")
    task = build_task(cfg.task)
    task.correct_reward = 0.75  # a task whose correct answers earn 0.75: the store keeps rollouts by it
    assert build_store(RunSettings(cfg), task).correct_reward == 0.75
    assert build_store(RunSettings(compose_config("buffer=age2")), task).ratio > 0  # a store without the knob is built as before
