"""The report's paper table fits a column, and its completions section quotes what a run logged with log_table."""

from __future__ import annotations

import mlflow
import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from analysis import latex
from analysis.completions import quote_table
from analysis.markdown import completions_section
from analysis.runs import load_runs
from analysis.tables import ReportData


def _results(rows: list[tuple]) -> pd.DataFrame:
    """A results table as analysis.tables builds it: (variant, plain, rho, coordinates, fresh evals) per row."""
    return pd.DataFrame([{"variant": variant, "plain": plain, "rho": rho, "coordinates": coordinates,
                          "fresh_evaluations": fresh, "protocol": "quick", "k_max": 8,
                          "pass@1": 0.3125, "pass@1_hw": 0.0412, "pass@k_max": 0.5625, "pass@k_max_hw": 0.0833,
                          "reward": 0.4021, "reward_hw": 0.0377} for variant, plain, rho, coordinates, fresh in rows])


DEMO = [("Fresh-only", True, 0.0, "(0, -, -)", 30720), ("Replay-RLOO", True, 1.0, "(1, 1, 1)", 15616)]


def test_text_width_follows_computer_modern():
    # cmr10 at 9 pt: digits are 4.5 pt wide, 'm' 7.5 pt, 'i' 2.5 pt (the TFM widths of cmr10 scaled by 0.9).
    assert latex.text_width_pt("0123456789") == pytest.approx(45.0, abs=0.5)
    assert latex.text_width_pt("mmmm") == pytest.approx(30.0, abs=0.5)
    assert latex.text_width_pt("iiii") == pytest.approx(10.0, abs=0.5)
    assert latex.text_width_pt("0.412±0.031") > latex.text_width_pt("0.4120.031")  # ± is typeset too


def test_demo_table_fits_one_column():
    text = latex.results_latex(_results(DEMO))
    headers, rows = latex.results_cells(_results(DEMO))
    width = latex.table_width_pt(headers, rows)
    assert width <= latex.COLUMN_WIDTH_PT, width
    assert r"\begin{table}[t]" in text and "table*" not in text and r"\small" in text
    assert rows[1] == ["(1, 1, 1)", "15.6K", ".312±.041", ".562±.083", ".402±.038"]
    assert r"Fresh-only & 30.7K & .312$\pm$.041" in text


def test_the_old_twelve_column_table_is_measured_too_wide():
    """The table this replaced (12 columns, 3-decimal values, long headers) came out at 342 pt in pdflatex."""
    headers = ["variant", "(ρ, L, c)", "cell", "protocol", "rollouts (fresh evals)", "gradient steps",
               "effective ratio", "pass@1", "pass@8", "reward", "correction rate", "run"]
    row = ["Replay-RLOO", "(1, 1, 1)", "rho1-L1-c1", "quick", "15.6K", "60", "0.625", "0.312 ± 0.041",
           "0.562 ± 0.083", "0.402 ± 0.038", "0.301 ± 0.020", "`0123abcd`"]
    assert latex.table_width_pt(headers, [row]) > 1.3 * latex.COLUMN_WIDTH_PT


def test_a_table_too_wide_for_a_column_spans_both():
    wide = _results([*DEMO, ("FIFO replay δ=0.5 R=2 + DAPO dynamic sampling + frontier curriculum", False, np.nan,
                             "-", 51712)])
    text = latex.results_latex(wide)
    assert r"\begin{table*}[t]" in text and r"\end{table*}" in text
    assert r"FIFO replay $\delta$=0.5" in text


COMPLETIONS = {"step": [1, 1, 2, 2, 2, 2], "problem": ["numbers 3, 5, 7; target 22"] * 6,
               "prompt": ["A conversation between User and Assistant. ... numbers [3, 5, 7] ... 22"] * 6,
               "response": ["old", "old", "<answer> 3*5+7 </answer>", "<answer> 22 </answer>", "mid", "bad"],
               "reward": [1.0, 0.0, 1.0, 0.1, 0.5, 0.0], "reason": ["ok", "x", "ok", "format", "close", "wrong"],
               "category": ["", "", "", "format_error", "wrong_target", "arithmetic_error"],
               "source": ["fresh", "fresh", "replay", "fresh", "fresh", "fresh"], "age": [0, 0, 1, 0, 0, 0],
               "weight": [1.0, 1.0, 0.8, 1.0, 1.0, 1.0]}


@pytest.fixture()
def store(tmp_path):
    """Two runs: one logged a completions table with mlflow.log_table, the other none."""
    previous = mlflow.get_tracking_uri()
    uri = f"sqlite:///{tmp_path}/mlruns.db"
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.create_experiment("quotes", artifact_location=(tmp_path / "artifacts").as_uri())
    ids = {}
    for cell, table in (("rho1-L1-c1", COMPLETIONS), ("rho0", None)):
        with mlflow.start_run(experiment_id=experiment, tags={"cell": cell}) as run:
            if table is not None:
                mlflow.log_table(data=table, artifact_file="completions/train.json")
            ids[cell] = run.info.run_id
    yield uri, ids, load_runs(uri, "quotes")
    mlflow.set_tracking_uri(previous)


def _data(runs: pd.DataFrame, quotes) -> ReportData:
    results = pd.DataFrame({"run_id": runs["run_id"], "cell": runs["tags.cell"], "variant": "Replay-RLOO"})
    empty = pd.DataFrame()
    return ReportData(used=runs, superseded=empty, unfinished=empty, results=results, cells=empty, history=empty,
                      variants=empty, probe=empty, probe_ks=[], failures=empty, completions=quotes)


def test_completions_are_quoted_best_median_worst_at_the_last_step(store):
    uri, ids, runs = store
    quotes = quote_table(MlflowClient(uri), runs)
    assert set(quotes["run_id"]) == {ids["rho1-L1-c1"]}  # the run without a table quotes nothing
    assert quotes["pick"].tolist() == ["best", "median", "worst"]
    assert quotes["step"].tolist() == [2, 2, 2]  # the last step only: step 1's rows are never quoted
    assert quotes["reward"].tolist() == [1.0, 0.1, 0.0]
    assert quotes.loc[0, "source"] == "replay" and quotes.loc[0, "table"] == "train"
    text = "\n".join(completions_section(_data(runs, quotes)))
    assert "### rho1-L1-c1 (Replay-RLOO), `train` table, step 2" in text
    assert "**best** (reward 1.000, source replay, age 1):" in text
    assert "    <answer> 3*5+7 </answer>" in text and "verifier: wrong" in text
    assert "    problem:\n    numbers 3, 5, 7; target 22\n" in text and "A conversation" not in text  # the task's words


def test_a_completions_table_without_the_problem_column_quotes_the_end_of_the_prompt():
    from analysis import markdown

    row = pd.Series({"problem": pd.NA, "prompt": "A conversation between User and Assistant. " * 10 +
                     "Using the numbers [3, 5, 7], create an equation that equals 22."})
    lines = markdown._problem_lines(row)
    assert lines[0] == "    prompt (its end):" and lines[1].endswith("create an equation that equals 22.")


def test_without_completions_tables_the_section_says_so(store):
    uri, ids, runs = store
    without = runs[runs["run_id"] == ids["rho0"]]
    assert quote_table(MlflowClient(uri), without) is None
    text = "\n".join(completions_section(_data(without, None)))
    assert "_Left out: no run of this report logged a completions table" in text
