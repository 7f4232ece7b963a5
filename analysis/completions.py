"""What the policy wrote: a few completions per cell, quoted from the run's MLflow completions table.

A run logs its sampled completions with `mlflow.log_table` as `completions/train.json` (rows: step,
problem (the task's own words for the instance), prompt, response, reward, reason, category, source, age, weight) and its evaluation samples as
`completions/eval.json` (the same columns where they apply). The report quotes, for each used run,
the best, the median and the worst reward at the run's last logged step, from the training table when
the run has one, else from the evaluation table. A run without either table is listed as such.
"""

from __future__ import annotations

import pandas as pd
from mlflow.tracking import MlflowClient

TABLES = [("train", "completions/train.json"), ("eval", "completions/eval.json")]  # the first a run has is quoted
PICKS = ["best", "median", "worst"]
COLUMNS = ["run_id", "table", "pick", "step", "problem", "prompt", "response", "reward", "reason", "category",
           "source", "age", "weight"]


def load_completions(client: MlflowClient, experiment_id: str, run_id: str) -> tuple[str, pd.DataFrame]:
    """(table name, rows) of the first completions table the run logged; ('', empty) when it logged none."""
    logged = {artifact.path for artifact in client.list_artifacts(run_id, "completions")}
    for name, artifact in TABLES:
        if artifact in logged:
            table = client.load_table(experiment_id, artifact, run_ids=[run_id])
            if not table.empty:
                return name, table
    return "", pd.DataFrame()


def pick_quotes(table: pd.DataFrame) -> pd.DataFrame:
    """Best, median and worst reward at the table's last step (fewer when the step has fewer rows)."""
    if table.empty or "reward" not in table:
        return table.iloc[0:0]
    last = table[table["step"] == table["step"].max()] if "step" in table else table
    ranked = last.sort_values("reward", ascending=False, kind="stable").reset_index(drop=True)
    positions = {"best": 0, "median": len(ranked) // 2, "worst": len(ranked) - 1}
    chosen, seen = [], set()
    for pick in PICKS:
        if positions[pick] not in seen:
            seen.add(positions[pick])
            chosen.append(ranked.iloc[positions[pick]].to_dict() | {"pick": pick})
    return pd.DataFrame(chosen)


def quote_table(client: MlflowClient, used: pd.DataFrame) -> pd.DataFrame | None:
    """The quoted completions of every used run (COLUMNS); None when no used run logged a completions table."""
    frames = []
    for _, run in used.iterrows():
        name, table = load_completions(client, str(run["experiment_id"]), run["run_id"])
        quotes = pick_quotes(table)
        if not quotes.empty:
            frames.append(quotes.assign(run_id=run["run_id"], table=name))
    if not frames:
        return None
    quotes = pd.concat(frames, ignore_index=True)
    for column in COLUMNS:
        if column not in quotes:
            quotes[column] = pd.NA
    return quotes[COLUMNS]
