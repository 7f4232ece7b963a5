"""End to end (SPEC 12 done-when): `python -m src.run task=math` trains the tiny math policy on the built-in
set, and with `task.data=<a folder of parquet files>` on the user's data; both log to MLflow."""

from __future__ import annotations

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from tests.e2e.test_run_e2e import run_cli, runs

pytestmark = pytest.mark.slow

SMALL = ("trainer.steps=2", "trainer.groups_per_step=4", "trainer.group_size=2", "evaluation.prompts=3",
         "evaluation.samples_per_prompt=2", "evaluation.ks=[1,2]", "task.train_size=200", "task.heldout_size=10")


def finished_run(store, sweep):
    table = runs(store, sweep)
    assert len(table) == 1
    run = MlflowClient(store).get_run(table.run_id[0])
    assert run.info.status == "FINISHED"
    return run


@pytest.mark.long  # make test-long (docs/testing.md): the suite trains math from parquet files
def test_math_trains_on_the_builtin_set(tmp_path):
    _, store = run_cli(tmp_path, "task=math", *SMALL, "tracking.sweep=math-e2e")
    run = finished_run(store, "math-e2e")
    assert run.data.params["policy.name_or_path"] == "checkpoints/tiny-math"
    assert run.data.metrics["budget/fresh_evaluations"] == 16  # 4 groups of 2 responses at each of 2 steps
    for key in ("train/reward", "quick/final/pass_at_1", "quick/final/unique_rate", "quick/final/failures/rollouts"):
        assert key in run.data.metrics, key
    categories = {key.rsplit("/", 1)[1] for key in run.data.metrics if key.startswith("quick/final/failures/")}
    assert {"no_boxed_answer", "wrong_answer", "truncated"} <= categories


def test_math_trains_on_a_folder_of_parquet_files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    problems = [(f"What is {a} plus {a}?", str(2 * a)) for a in range(40)]
    for part in range(2):
        rows = problems[part * 20 : (part + 1) * 20]
        pd.DataFrame({"problem": [q for q, _ in rows], "answer": [a for _, a in rows]}).to_parquet(
            data / f"train-0000{part}-of-00002.parquet")
    _, store = run_cli(tmp_path, "task=math", f"task.data={data}", *SMALL[1:], "trainer.steps=1",
                       "tracking.sweep=math-files")
    run = finished_run(store, "math-files")
    assert run.data.params["task.data"] == str(data)
    assert run.data.metrics["budget/fresh_evaluations"] == 8  # one step of 4 groups of 2
