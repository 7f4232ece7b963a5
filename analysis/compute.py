"""What a run cost besides verifier calls (seed 001 reports compute, not only samples): generated and
trained tokens and training wall time, read back from MLflow for the compute frontier.

* `budget/generated_tokens` and `budget/trained_tokens` are cumulative per-step metrics; the run's
  last value is its total. Runs that did not log them have none, and the report
  says so instead of drawing a panel.
* Training wall time is the sum of the per-step `time/step` (seconds of the training steps only: no
  evaluation, no model loading, and no time a resumed run spent dead); a run without it falls back
  to its end minus start time.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

TOKEN_METRICS = {"generated_tokens": "budget/generated_tokens", "trained_tokens": "budget/trained_tokens"}
STEP_TIME = "time/step"
HISTORY_KEYS = [STEP_TIME]  # per-step series the report must fetch for this module
COLUMNS = ["generated_tokens", "trained_tokens", "wall_time_s"]
# The frontier's x axes: (column, axis label, what a missing panel says).
AXES = [
    ("fresh_evaluations", "fresh verifier evaluations", "no fresh-evaluation counts logged"),
    ("trained_tokens", "trained tokens (response tokens in the loss, cumulative)",
     "no budget/trained_tokens logged by these runs"),
    ("wall_time_s", "training wall time (s, sum of time/step)", "no time/step or start/end time for these runs"),
]


def wall_time_seconds(history: pd.DataFrame, runs: pd.DataFrame) -> pd.Series:
    """Training seconds per run id: the sum of `time/step` over steps, else end - start of the run."""
    steps = history[history["key"] == STEP_TIME].groupby("run_id")["value"].sum() if not history.empty \
        else pd.Series(dtype=float)
    fallback = {}
    for _, run in runs.iterrows():
        start, end = run.get("start_time"), run.get("end_time")
        if start is not None and end is not None and not pd.isna(start) and not pd.isna(end):
            fallback[run["run_id"]] = (pd.Timestamp(end) - pd.Timestamp(start)).total_seconds()
    return pd.Series({run_id: steps.get(run_id, fallback.get(run_id, np.nan)) for run_id in runs["run_id"]},
                     dtype=float)


def compute_columns(results: pd.DataFrame, used: pd.DataFrame, history: pd.DataFrame) -> pd.DataFrame:
    """`results` with generated_tokens, trained_tokens (last logged value, NaN when never logged) and wall_time_s."""
    out = results.copy()
    if out.empty:
        for column in COLUMNS:
            out[column] = pd.Series(dtype=float)
        return out
    totals = used.set_index("run_id")
    for column, key in TOKEN_METRICS.items():
        values = totals[f"metrics.{key}"] if f"metrics.{key}" in totals else pd.Series(np.nan, index=totals.index)
        out[column] = out["run_id"].map(values).astype(float)
    out["wall_time_s"] = out["run_id"].map(wall_time_seconds(history, used))
    return out


def missing_axes(cells: pd.DataFrame) -> list[str]:
    """What each absent frontier panel lacks, for the report's note (empty when every panel has points)."""
    return [why for column, _, why in AXES if column not in cells or cells[column].isna().all()]
