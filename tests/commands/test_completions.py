"""Sample completions as MLflow tables (`completions/train.json`, `completions/eval.json`), the headline
metrics a finished run carries, and its flat params."""

from __future__ import annotations

import json
import math

import mlflow
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient

from src.runs.completions import (EVAL_COLUMNS, EVAL_COMPLETIONS, LATEST_HEADING, SECTION_END, TRAIN_COLUMNS,
                                  TRAIN_COMPLETIONS, completion_rows, completions_markdown)
from src.runs.links import SUMMARY_COLUMNS
from src.runs.naming import DESCRIPTION_TAG
from src.batch import Batch, BatchGroup, Group
from src.loss.trainer import UpdateResult
from src.sampling.collection import FreshGroups
from src.task.countdown import CountdownTask
from src.train import StepBatch


def read_table(client: MlflowClient, run_id: str, path: str, folder) -> pd.DataFrame:
    """A table `mlflow.log_table` wrote (pandas' split orient)."""
    with open(client.download_artifacts(run_id, path, str(folder))) as handle:
        split = json.load(handle)
    return pd.DataFrame(split["data"], columns=split["columns"])


def countdown_group(responses, rewards, step) -> Group:
    return Group(prompt="Using [3, 5] make 8", prompt_ids=[1, 2], truth={"numbers": [3, 5], "target": 8},
                 responses=responses, response_ids=[[7] * 3, [7] * 4], rewards=rewards, step=step)


def test_completion_rows_carry_the_verifier_reason_the_failure_category_the_source_and_the_weight():
    fresh = countdown_group(["<answer>3 + 5</answer>", "<answer>3 * 5</answer>"], [1.0, 0.1], step=4)
    old = countdown_group(["no answer at all", "<answer>3 + 5</answer>"], [0.0, 1.0], step=2)
    batch = Batch([BatchGroup(fresh), BatchGroup(old, "replay", 2)])
    weights = torch.tensor([1.0, 1.0, 0.5, 2.0])
    update = UpdateResult(logprobs=torch.zeros(4), raw_weights=weights * 3, weights=weights, kl_sums=torch.zeros(4),
                          token_counts=torch.ones(4), reference_tokens=[()] * 4, loss=0.0, policy_loss=0.0, kl=0.0,
                          entropy=0.0)
    collection = StepBatch(4, batch, FreshGroups([fresh], [fresh], False), 0, update=update)
    rows = pd.DataFrame(completion_rows(collection.completions(10), CountdownTask(), max_new_tokens=16))
    assert list(rows.columns) == list(TRAIN_COLUMNS)
    assert len(rows) == 4 and set(rows.step) == {4}
    assert set(rows.problem) == {"numbers 3, 5; target 8"}  # the task's words, not the prompt's opening
    by_response = rows.set_index(["source", "response"])
    right = by_response.loc[("fresh", "<answer>3 + 5</answer>")]
    assert (right.reward, right.reason, right.category, right.age, right.weight) == (1.0, "correct", "", 0, 1.0)
    wrong = by_response.loc[("fresh", "<answer>3 * 5</answer>")]
    assert (wrong.reward, wrong.category) == (0.1, "wrong_target") and wrong.reason != "correct"
    replayed = by_response.loc[("replay", "no answer at all")]
    assert (replayed.reward, replayed.category, replayed.age, replayed.weight) == (0.0, "format_error", 2, 0.5)
    assert len(completion_rows(collection.completions(2), CountdownTask(), 16)) == 2  # the configured count
    assert completion_rows(collection.completions(0), CountdownTask(), 16) == []  # 0 turns it off


def test_a_math_group_is_briefed_by_its_problem_not_its_instructions():
    from src.task.math.data import MathProblem
    from src.task.math.task import MathTask

    task = MathTask()
    problem = MathProblem(question="What is 12 + 30?", answer="42")
    group = Group(prompt=task.prompt(problem), prompt_ids=[1], truth="42",
                  responses=["\\boxed{42}", "41"], response_ids=[[1], [2]], rewards=[1.0, 0.0], step=0)
    assert task.instance_of(group) == problem and task.brief(task.instance_of(group)) == "What is 12 + 30?"
    assert task.brief(MathProblem("x " * 400, "1")).endswith("…") and len(task.brief(MathProblem("x " * 400, "1"))) < 310
    task.close()


def test_the_latest_completions_are_a_markdown_table_of_the_problem_and_the_end_of_the_response():
    rows = [{"step": 7, "problem": "numbers 3, 5; target 8", "response": "x" * 500 + " <answer>3 + 5</answer>",
             "reward": 1.0, "reason": "correct", "source": "replay", "age": 2},
            {"step": 7, "problem": "numbers 1, 2; target 3", "response": "a | b\nc", "reward": 0.1,
             "reason": "wrong target", "source": "fresh", "age": 0}]
    text = completions_markdown(rows)
    lines = text.splitlines()
    assert lines[0].startswith(LATEST_HEADING + " (step 7;")
    assert lines[2] == "| problem | reward | verifier | source | response (its end) |"
    assert lines[4].startswith("| numbers 3, 5; target 8 | 1 | correct | replay, age 2 | …xx")
    assert lines[4].endswith(" &lt;answer&gt;3 + 5&lt;/answer&gt; |")
    assert lines[5] == "| numbers 1, 2; target 3 | 0.1 | wrong target | fresh | a &#124; b c |"  # one line a row


@pytest.mark.slow
def test_a_one_step_run_logs_a_completions_table_and_summary_metrics(tmp_path, random_policy_dir, compose_config):
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    import src.run

    store = f"sqlite:///{tmp_path}/mlruns.db"
    cfg = compose_config(f"policy.name_or_path={random_policy_dir}", "trainer.steps=1", "trainer.groups_per_step=2",
                         "trainer.group_size=2", "policy.max_new_tokens=4", "evaluation.prompts=3",
                         "evaluation.samples_per_prompt=2", "evaluation.ks=[1,2]", "tracking.completions_per_step=3",
                         f"tracking.uri={store}", "tracking.sweep=completions",
                         f"tracking.artifact_location={tmp_path}/artifacts", f"hydra.run.dir={tmp_path}/run",
                         hydra=True)
    cfg.hydra.runtime.output_dir = str(tmp_path / "run")
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    src.run.train(cfg)
    mlflow.set_tracking_uri(store)
    run_id = mlflow.search_runs(experiment_names=["replay-rloo"]).run_id[0]
    client = MlflowClient(store)
    train = read_table(client, run_id, TRAIN_COMPLETIONS, tmp_path)
    assert list(train.columns) == list(TRAIN_COLUMNS)
    assert len(train) == 3 and set(train.step) == {0} and set(train.source) == {"fresh"}
    assert train.reason.str.len().min() > 0 and train.prompt.str.contains("numbers").all()
    assert train.problem.str.match(r"numbers \d+(, \d+)+; target \d+$").all()
    evaluation = read_table(client, run_id, EVAL_COMPLETIONS, tmp_path)
    assert list(evaluation.columns) == list(EVAL_COLUMNS)
    assert evaluation.problem.str.match(r"numbers \d+(, \d+)+; target \d+$").all()
    description = client.get_run(run_id).data.tags[DESCRIPTION_TAG]
    assert description.startswith(LATEST_HEADING + " (step 0;")  # first: the run page folds the rest
    assert description.split(SECTION_END)[1].startswith("**Fresh-only**, cell `rho0`")
    assert all(f"| {problem} |" in description for problem in train.problem)  # the run page shows them
    assert sorted(evaluation.step) == [0, 0, 0, 1, 1, 1]  # at the start (step 0) and after the one step
    params = client.get_run(run_id).data.params
    assert params["buffer.ratio"] == "0.0" and not [key for key in params if "_target_" in key]  # flat, readable
    assert (params["rho"], params["L"], params["c"]) == ("0", "0", "10")  # the paper's names (fresh-only: L 0)
    with open(client.download_artifacts(run_id, "config.yaml", str(tmp_path))) as config:
        assert "_target_: src." in config.read()  # the class paths stay in the config artifact
    metrics = client.get_run(run_id).data.metrics
    for key in SUMMARY_COLUMNS:
        assert key in metrics and math.isfinite(metrics[key]), key
    assert metrics["k"] == 2 and metrics["fresh_evals"] == 4  # 2 groups x 2 responses
    assert metrics["final_reward"] == metrics["quick/final/mean_reward"]
    assert metrics["pass_at_1"] == metrics["quick/final/pass_at_1"] and metrics["pass_at_k"] == metrics[
        "quick/final/pass_at_2"]
    assert metrics["wall_time_min"] == round(metrics["wall_time_min"], 1)  # to a tenth of a minute
