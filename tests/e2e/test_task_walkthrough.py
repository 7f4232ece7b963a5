"""docs/tasks.md, as a researcher follows it: its two files written into an empty folder outside the
repository, and its command run from there at tiny settings."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.commands.test_cli import ROOT, src_run

TINY = ["trainer.steps=2", "trainer.groups_per_step=2", "trainer.group_size=2", "policy.max_new_tokens=8",
        "evaluation.prompts=2", "evaluation.samples_per_prompt=2", "evaluation.ks=[1]", "evaluation.at_start=false",
        "hardware.threads=1"]


def walkthrough(folder: Path) -> list[str]:
    """The page's python and yaml blocks written under `folder` (each block's first line names its path), and
    the command it shows, after `python -m src.run`."""
    blocks = re.findall(r"```(\w+)\n(.*?)```", (ROOT / "docs" / "tasks.md").read_text(), re.S)
    for language, body in blocks:
        if language in ("python", "yaml"):
            path = folder / body.splitlines()[0].lstrip("# ").strip()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
    (command,) = [body.strip() for language, body in blocks if language == "bash"]
    assert command.startswith("python -m src.run "), command
    return shlex.split(command)[3:]


@pytest.mark.slow
def test_the_task_of_docs_tasks_trains_from_a_folder_outside_the_repository(tmp_path):
    argv = walkthrough(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["my_conf", "my_tasks"]
    done = src_run([*argv, *TINY], tmp_path, cwd=tmp_path)
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 0, out[-3000:]
    assert "rho0-digitsum" in out and "fresh verifier evaluations: 8 (planned 8)" in out, out[-3000:]


def test_a_bad_setting_of_the_docs_task_is_one_line_before_any_compute(tmp_path):
    argv = walkthrough(tmp_path)
    done = src_run([*argv, *TINY, "task.train_size=9999"], tmp_path, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "task.train_size=9999: 4-digit numbers give 9000 instances in all; lower task.train_size" in done.stderr
    assert not (tmp_path / "m.db").exists()


@pytest.mark.parametrize("setting, said", [
    ("task.digits=7", "task.digits=7"),  # outside the range the task's class declares
    ("task.digitz=3", "did you mean task.digits?"),  # a key the class does not declare
])
def test_the_docs_tasks_own_knob_is_checked_as_a_variants_is(tmp_path, setting, said):
    argv = walkthrough(tmp_path)
    done = src_run([*argv, *TINY, setting], tmp_path, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "m.db").exists()
