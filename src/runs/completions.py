"""A run's sample completions: rows of MLflow tables, a line on the console, the top of the run's description.

A step logs some of the responses it trained on (`completion_rows`), an evaluation its samples
(`eval_completion_rows`), each as rows appended to the run's completions table; analysis/ reads those tables. The
latest step's rows also open the run's description (`completions_markdown`), so its page shows what the policy
writes.
"""

from __future__ import annotations

from mlflow.tracking import MlflowClient


# Sample completions as MLflow tables (`mlflow.log_table` appends to an existing file); analysis/ reads
# these names and columns.
TRAIN_COMPLETIONS = "completions/train.json"
EVAL_COMPLETIONS = "completions/eval.json"
TRAIN_COLUMNS = ("step", "problem", "prompt", "response", "reward", "reason", "category", "source", "age", "weight")
EVAL_COLUMNS = ("step", "problem", "prompt", "response", "reward", "reason", "category")


def completion_rows(picked: list, task, max_new_tokens: int) -> list[dict]:
    """The rows of a step's picked responses (`src.train.Completion`s), one each: the reward trained on, and the
    verifier's reason and the failure category (empty for a correct response) from verifying the response again."""
    rows = []
    for done in picked:
        group, j = done.group, done.index
        response = group.responses[j]
        instance = task.instance_of(group)
        verdict = task.verify(response, instance)
        correct = group.rewards[j] == task.correct_reward
        truncated = len(group.response_ids[j]) >= max_new_tokens
        rows.append({"step": done.step, "problem": task.brief(instance), "prompt": group.prompt, "response": response,
                     "reward": group.rewards[j], "reason": verdict.reason,
                     "category": "" if correct else task.classify_failure(response, verdict, truncated),
                     "source": done.source, "age": done.age, "weight": done.weight})
    return rows


def completion_line(row: dict, width: int = 160) -> str:
    """One completion row as console lines: the step (counted from 1, as the progress bar counts), the reward and
    where the response came from, then the prompt's end and the response, each cut to `width` characters."""
    def cut(text: str) -> str:
        text = " ".join(str(text).split())
        return text if len(text) <= width else text[: width - 3] + "..."

    reason = f", {row['category']}" if row["category"] else ""
    return (f"completion, step {row['step'] + 1}: reward {row['reward']:g} ({row['source']}, age {row['age']}{reason})"
            f"\n  prompt: ...{cut(row['prompt'][-width:])}\n  response: {cut(row['response'])}")


def log_completions(run_id: str, rows: list[dict], artifact_file: str) -> None:
    """Append rows to a run's completions table (MLflow reads the existing file and writes it back longer)."""
    if rows:
        import pandas as pd

        MlflowClient().log_table(run_id, data=pd.DataFrame(rows), artifact_file=artifact_file)


# The run page renders the description as markdown, folded to its first few lines: the latest step's completions
# go first, so a researcher reads what the policy writes without opening the artifacts; a rule parts them from
# the cell in words.
LATEST_HEADING = "**Latest completions**"
SECTION_END = "\n\n---\n\n"
RESPONSE_CHARS = 240  # a response's end in the description: the answer is there
# At most this many rows there: a row is up to about 500 characters, and MLflow keeps 8000 in a tag
# (MAX_TAG_VAL_LENGTH, mlflow/utils/validation.py:73), the cell's own description included.
DESCRIPTION_ROWS = 8


def markdown_cell(text, limit: int, tail: bool = False) -> str:
    """Text for one markdown table cell: one line, cut to `limit` characters (its end with `tail`), with the
    characters markdown or the page's HTML would take (`|`, `<think>`) written as entities."""
    text = " ".join(str(text).split())
    if len(text) > limit:
        text = "…" + text[-limit:] if tail else text[:limit] + "…"
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "&#124;")


def completions_markdown(rows: list[dict]) -> str:
    """A step's completion rows (`completion_rows`) as the description's markdown section."""
    lines = [f"{LATEST_HEADING} (step {rows[0]['step']}; every step's are in `{TRAIN_COMPLETIONS}`)", "",
             "| problem | reward | verifier | source | response (its end) |", "|---|---|---|---|---|"]
    for row in rows[:DESCRIPTION_ROWS]:
        source = row["source"] + (f", age {row['age']}" if row["source"] != "fresh" else "")
        lines.append(f"| {markdown_cell(row['problem'], 120)} | {row['reward']:g} | {markdown_cell(row['reason'], 60)} "
                     f"| {source} | {markdown_cell(row['response'], RESPONSE_CHARS, True)} |")
    return "\n".join(lines)


def eval_completion_rows(result, step: int) -> list[dict]:
    """The evaluation's sample completions (`EvalResult.samples`) as rows of the eval completions table."""
    samples = getattr(result, "samples", None)
    if samples is None or samples.empty:
        return []
    return [{"step": step, **{column: record[column] for column in EVAL_COLUMNS[1:]}}
            for record in samples.to_dict("records")]
