"""make reproduce-seedNNN: each paper's claim judged over training seeds (analysis/claims.py), and each target run
as a user types it at tiny settings (slow)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from analysis.claims import CLAIMS, NOT_TESTABLE, REPRODUCED, UNDECIDED, VERDICTS, Comparison, assign_roles
from analysis.reproduce import comparison_table
from tests.conftest import PROJECT_ROOT

SEEDS = pd.Index([0, 1, 2])


def compared(expect: str, differences, margin: float = 0.02) -> dict:
    """A comparison whose method beats the baseline by `differences` at seeds 0, 1, 2, as the report reads it."""
    baseline = pd.Series([0.30, 0.40, 0.35], index=SEEDS)
    comparison = Comparison("m vs b", expect, baseline + np.asarray(differences), baseline, "p", margin, "why")
    return {**vars(comparison), **comparison.judged()}


def test_the_table_gives_the_claims_test_its_power_and_the_seeds_that_would_decide():
    open_row = comparison_table([compared("at least", [0.03, -0.02, 0.01])])[-1]
    assert "| at least (0.02: why) |" in open_row and "| 3 | undecided (" in open_row
    assert "(a new study: " in open_row and "worse" not in open_row  # the last look: no seeds added to this one
    interim = comparison_table([compared("at least", [0.03, -0.02, 0.01])], next_look=14)[-1]
    assert "| undecided (next look: 14 seeds) |" in interim
    constant = comparison_table([compared("lower", [-300.0, -300.0, -300.0], 0.26)])[-1]
    assert "| none | 0.000 | 3 | no spread: no test |" in constant  # a constant difference is no p = 0


def test_one_seed_is_no_data():
    one = Comparison("m vs b", "higher", pd.Series([0.9], index=[0]), pd.Series([0.1], index=[0]), "p").judged()
    assert one["outcome"] == "no data" and one["agrees"] is None


def fake_runs(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{"run_id": f"r{i}", **row} for i, row in enumerate(rows)])


def test_runs_outside_every_role_are_left_out():
    runs = assign_roles(fake_runs([{"tags.curriculum": "frontier"}, {"tags.curriculum": "failure"}]), CLAIMS["seed004"])
    assert list(runs["role"]) == ["frontier"]


# --------------------------------------------------------------------------- the make targets, as typed

TINY = "trainer.steps=2 trainer.group_size=4 evaluation.prompts=3 evaluation.samples_per_prompt=4 evaluation.ks=[1,4]"
# What each target needs beyond TINY: seed 004's replay fraction of 0.10 replaces a prompt only from 10 groups,
# and its claim reads pass@32; seed 003's 4 mini-batch updates need groups in fours (its mini-batch of 8 prompts
# would not divide 4, so the count is set); seed 001's batches are
# rollouts, so its groups must fill them (60 rollouts of G = 16 at paper scale; 8 of 4 here).
# Only seed 000's curves need the warm start's evaluation.
EXTRA = {
    "seed000": "trainer.groups_per_step=4 evaluation.every=1",
    "seed001": "trainer.group_size=4 buffer.batch_rollouts=8 buffer.capacity=32 evaluation.at_start=false",
    "seed002": "trainer.groups_per_step=4 trainer.micro_batch_size=16 evaluation.at_start=false",
    "seed003": "trainer.groups_per_step=4 loss.updates_per_step=4 evaluation.at_start=false",
    "seed004": "trainer.groups_per_step=10 evaluation.samples_per_prompt=32 evaluation.ks=[1,8,32] "
               "evaluation.at_start=false evaluation.prompts=2",
}


# The verdicts these fixtures give, read off their reports (this test's own make commands). Measured for all five
# on one commit (the one that pinned seeds 000-002): seed 000's baseline ends where it started (it does not learn),
# so its claim is not testable at any seed count. The others are at 2 of their planned seeds, so their tests are
# withheld (undecided): at two steps the methods and baselines of seeds 002-004 score alike at both seeds (no spread,
# which more seeds may give), and seed 001's FIFO at (6, 2) differs from LIFO by seed on the fraction problems
# (+0.167 +- 1.059 over seeds 0 and 1). A fixture that starts to give another verdict has changed what it measures.
TINY_VERDICT: dict[str, str] = {name: UNDECIDED for name in ("seed001", "seed002", "seed003", "seed004")}
TINY_VERDICT["seed000"] = NOT_TESTABLE


# The suite runs seed 000's study (its cells, curves, verdict, and a rerun that trains nothing); the other four
# run by hand with make test-long: seed 001's eight Ray cells alone take over 8 minutes on 2 cores.
@pytest.mark.slow
@pytest.mark.parametrize("name", [name if name == "seed000" else pytest.param(name, marks=pytest.mark.long)
                                  for name in sorted(CLAIMS)])
def test_make_reproduce_runs_the_study_over_seeds_and_writes_the_verdict(tmp_path, name):
    extra = EXTRA[name].split()  # a key given twice is refused: EXTRA's value replaces TINY's
    words = [word for word in TINY.split() if word.split("=")[0] not in {w.split("=")[0] for w in extra}] + extra
    command = ["make", f"reproduce-{name}", "SEEDS=2", f"OUT={tmp_path}", f"ARGS={' '.join(words)}"]
    # A cap, not a speed target: seed 001's eight Ray cells took 16 min on 2 cores shared with two studies.
    result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    report = (tmp_path / "reports" / f"reproduce-{name}" / "README.md").read_text()
    claim = CLAIMS[name]
    assert report.startswith(f"## {claim.paper}: ")
    found = re.search(r"^\*\*Verdict: (.+?)\.\*\*", report, re.M)
    assert found and found.group(1) in VERDICTS, report
    # Two steps from the warm start at two seeds is no evidence for any claim: a "reproduced" here would be a
    # false agreement. Where the fixture's verdict was measured, it is pinned.
    assert found.group(1) != REPRODUCED, report
    if name in TINY_VERDICT:
        assert found.group(1) == TINY_VERDICT[name], report
    for role in claim.roles:  # every role of the claim ran at both seeds
        assert re.search(rf"^\| {re.escape(role)} \| .*\(2 seeds\)", report, re.M), (role, report)
    if name == "seed000":
        assert (tmp_path / "reports" / "reproduce-seed000" / "seed000-curves.png").stat().st_size > 10_000
        # Moved to another machine as docs/reproductions.md types it: its three folders in a tarball, the folder
        # emptied of them (a new machine), put back at the same path. Run again: every cell is finished, so
        # nothing trains and the same verdict is written.
        pack, unpack = moving_commands()
        subprocess.run(pack, shell=True, cwd=tmp_path, check=True)
        for name in ("mlruns.db", "mlartifacts", "outputs"):
            (shutil.rmtree if (tmp_path / name).is_dir() else os.remove)(tmp_path / name)
        subprocess.run(unpack.replace("../study-seed000", str(tmp_path)), shell=True, cwd=tmp_path, check=True)
        again = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]
        assert "6 finished (skipped)" in again.stdout + again.stderr and "train " not in again.stderr
        assert (tmp_path / "reports" / "reproduce-seed000" / "README.md").read_text() == report


def moving_commands() -> tuple[str, str]:
    """docs/reproductions.md's two tar commands that move a study: packing it, and unpacking it in the new checkout."""
    lines = (PROJECT_ROOT / "docs" / "reproductions.md").read_text().splitlines()
    pack = next(line for line in lines if line.startswith("tar czf "))
    unpack = next(line for line in lines if " && tar xzf " in line).split(" && ")[1]
    return pack.split("  #")[0].strip(), unpack.split("  #")[0].strip()


def test_seed001s_roles_follow_the_queue_not_the_buffer_size():
    # The tiny test's buffer holds 32 rollouts, the study's 252: the FIFO cells are whatever is not the LIFO pipe.
    cells = ["rho0-grpo-coupled-W6T2-N32-math", "rho0-grpo-coupled-W6T2-lifo-math", "rho0-grpo-coupled-W4T4-N252-math"]
    runs = assign_roles(fake_runs([{"tags.cell": cell} for cell in cells]), CLAIMS["seed001"])
    assert list(runs["role"]) == ["fifo-W6T2", "lifo-W6T2", "fifo-W4T4"]


@pytest.mark.parametrize("words, said", [
    (["seed999"], "'seed999' is not a reproduction: choose one of seed000"),
    ([], "name a reproduction first"),
    (["seed000", "trainer.stepz=3"], "trainer.stepz=3"),
])
def test_a_bad_reproduction_command_is_one_line(words, said, tmp_path):
    result = subprocess.run([sys.executable, "-m", "analysis.reproduce", *words], cwd=PROJECT_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and said in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
