"""Math problems from the files users hold (SPEC 12): parquet, jsonl/json or arrow, read with
`datasets.load_dataset`, with the question and answer columns named in the config.

Presets name the columns of the public sets' layouts, so `task.preset=gsm8k` is all a GSM8K copy needs:

    openr1      OpenR1-Math-220k     problem, answer
    deepscaler  DeepScaleR-Preview   problem, answer
    math500     MATH-500             problem, answer
    math        MATH (Hendrycks)     problem, solution (the answer is its last \\boxed{})
    gsm8k       GSM8K                question, answer (the final answer after '####')

Nothing is downloaded: `task.data` is a local file, a folder (searched recursively) or a glob. Two
problems are the same when their normalised text (lower case, whitespace collapsed) is; the held-out
set is disjoint from the training set by that key.
"""

from __future__ import annotations

import glob
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from src.task.math.verify import last_boxed

PRESETS: dict[str, tuple[str, str, str]] = {  # name: (question column, answer column, answer format)
    "openr1": ("problem", "answer", "plain"),
    "deepscaler": ("problem", "answer", "plain"),
    "math500": ("problem", "answer", "plain"),
    "math": ("problem", "solution", "boxed"),
    "gsm8k": ("question", "answer", "gsm8k"),
}
ANSWER_FORMATS = ("plain", "boxed", "gsm8k")
BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}
# What `Dataset.save_to_disk` writes beside its .arrow files: metadata, not rows.
METADATA_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")

_SPACE = re.compile(r"\s+")


def normalise_question(text: str) -> str:
    """The disjointness key of a problem: lower case, whitespace collapsed, stripped."""
    return _SPACE.sub(" ", text).strip().lower()


@dataclass(frozen=True)
class MathProblem:
    """One problem: its text, the reference answer, and (built-in set only) a worked solution for SFT."""

    question: str
    answer: str
    solution: str = field(default="", compare=False)

    @property
    def key(self) -> str:
        return normalise_question(self.question)


def columns_for(preset: str | None, question_column: str, answer_column: str,
                answer_format: str) -> tuple[str, str, str]:
    """(question column, answer column, answer format) of a preset, or the ones configured."""
    if preset is None:
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"task.answer_format='{answer_format}': choose one of {ANSWER_FORMATS}")
        return question_column, answer_column, answer_format
    if preset not in PRESETS:
        raise ValueError(f"task.preset='{preset}': choose one of {sorted(PRESETS)}, or null with "
                         "task.question_column and task.answer_column")
    return PRESETS[preset]


def data_files(path: str, key: str = "task.data") -> tuple[str, list[str]]:
    """(datasets builder, files) for a file, a folder (recursive) or a glob; one line naming the fix if none."""
    candidate = Path(path).expanduser()
    if candidate.is_dir():
        files = sorted(str(p) for p in candidate.rglob("*") if p.suffix in BUILDERS and p.is_file())
    elif candidate.is_file():
        files = [str(candidate)]
    else:
        files = sorted(glob.glob(str(candidate), recursive=True))
    files = [f for f in files if Path(f).suffix in BUILDERS and Path(f).name not in METADATA_FILES]
    if not files:
        raise ValueError(f"{key}='{path}': no .parquet, .jsonl, .json or .arrow file there; point it at a file, "
                         "a folder or a glob of them (nothing is downloaded)")
    builders = {BUILDERS[Path(f).suffix] for f in files}
    if len(builders) > 1:
        raise ValueError(f"{key}='{path}' mixes formats ({', '.join(sorted(builders))}); point it at one kind")
    return builders.pop(), files


def file_columns(builder: str, first_file: str) -> list[str]:
    """The column names of a data file, read from its schema or first record (cheap: no data loaded)."""
    if builder == "parquet":
        import pyarrow.parquet

        return list(pyarrow.parquet.read_schema(first_file).names)
    if builder == "arrow":
        import pyarrow

        with pyarrow.memory_map(first_file) as source:
            return list(pyarrow.ipc.open_stream(source).schema.names)
    with open(first_file, encoding="utf-8") as handle:
        text = handle.read(1) + handle.readline()
    if text.startswith("["):  # a JSON array: columns of its first object only, read in full
        with open(first_file, encoding="utf-8") as handle:
            rows = json.load(handle)
        return list(rows[0]) if rows else []
    return list(json.loads(text)) if text.strip() else []


def check_columns(path: str, columns: tuple[str, str, str], key: str = "task.data") -> None:
    """Refuse, in one line, data whose files lack the question or answer column."""
    builder, files = data_files(path, key)
    found = file_columns(builder, files[0])
    question, answer, _ = columns
    missing = [name for name in (question, answer) if name not in found]
    if missing:
        matches = [name for name, (q, a, _) in PRESETS.items() if q in found and a in found]
        hint = f"task.preset={matches[0]}" if matches else "task.question_column=... task.answer_column=..."
        raise ValueError(f"{key}='{path}': no column {missing} in {files[0]} (its columns: {', '.join(found)}); "
                         f"set {hint}")


def final_answer(raw, answer_format: str) -> str | None:
    """The reference answer of a row: as it is, the last boxed one, or GSM8K's after '####'."""
    text = str(raw).strip()
    if answer_format == "boxed":
        return last_boxed(text)
    if answer_format == "gsm8k":
        if "####" not in text:
            return None
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    return text


def load_problems(path: str, columns: tuple[str, str, str], key: str = "task.data") -> list[MathProblem]:
    """Every usable row of the data (question and reference answer present), in file order."""
    import datasets  # heavy: only when files are used

    builder, files = data_files(path, key)
    check_columns(path, columns, key)
    question_column, answer_column, answer_format = columns
    table = datasets.load_dataset(builder, data_files=files, split="train")
    problems = []
    for question, raw in zip(table[question_column], table[answer_column]):
        answer = final_answer(raw, answer_format) if raw is not None else None
        if question and str(question).strip() and answer:
            problems.append(MathProblem(str(question).strip(), answer))
    if not problems:
        raise ValueError(f"{key}='{path}': no row has both a question ({question_column}) and an answer "
                         f"({answer_column}, format {answer_format})")
    return problems


def distinct_sample(problems: list[MathProblem], count: int, seed: int, exclude: set[str] = frozenset()) -> list:
    """Up to `count` problems with distinct keys, none in `exclude`, in a seeded random order."""
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    chosen, keys = [], set(exclude)
    for index in order:
        if len(chosen) >= count:
            break
        problem = problems[index]
        if problem.key not in keys:
            keys.add(problem.key)
            chosen.append(problem)
    return chosen
