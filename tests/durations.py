"""Where the suite's time goes: the slowest tests of a `make test`, read from pytest's JUnit XML files.

    python -m tests.durations [--top 30] [--write tests/durations.json] REPORT.xml [REPORT.xml ...]

prints a Markdown table of the `--top` slowest tests (setup, call and teardown added up, as pytest's
`--durations` counts them) with the first line of each test's docstring, the slowest files, and the total per
report. With `--write` it also records each test's seconds: tests/conftest.py hands the heaviest tests to the
parallel workers first from that record. `make test-durations` runs both halves and calls this.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Tests quicker than this are left out of the record: tests/conftest.py counts each of them as 0.1 s.
RECORD_FLOOR = 0.5


def read_cases(report: Path) -> list[dict]:
    """Each test case of one JUnit file: its node id, file, seconds and outcome."""
    cases = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        module, name = case.get("classname", ""), case.get("name", "")
        path = module.replace(".", "/") + ".py"
        outcome = "skipped" if case.find("skipped") is not None else (
            "failed" if case.find("failure") is not None or case.find("error") is not None else "passed")
        cpu = [float(prop.get("value", "nan")) for prop in case.iter("property") if prop.get("name") == "cpu_seconds"]
        properties = {prop.get("name"): prop.get("value") for prop in case.iter("property")}
        cases.append({"id": f"{path}::{name}", "file": path, "name": name, "seconds": float(case.get("time", 0)),
                      "cpu": cpu[0] if cpu else None, "outcome": outcome,
                      "started": float(properties["started"]) if "started" in properties else None,
                      "worker": properties.get("worker")})
    return cases


def docstring_line(path: str, name: str) -> str:
    """The first line of the test function's docstring, else its name in words."""
    function = name.split("[", 1)[0]
    try:
        tree = ast.parse((ROOT / path).read_text())
    except (OSError, SyntaxError):
        return function.removeprefix("test_").replace("_", " ")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            doc = ast.get_docstring(node)
            if doc:
                return doc.strip().splitlines()[0]
    return function.removeprefix("test_").replace("_", " ")


def cpu_text(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.0f}"


def table(cases: list[dict], top: int) -> str:
    """The `top` slowest tests by wall seconds, each with its CPU-seconds (tests/conftest.py records them: the
    test's process and the commands it waited for; blank in a report written without them)."""
    rows = ["| # | seconds | CPU-s | test | what it checks |", "|---:|---:|---:|---|---|"]
    for rank, case in enumerate(sorted(cases, key=lambda c: -c["seconds"])[:top], 1):
        what = docstring_line(case["file"], case["name"]).replace("|", "\\|")
        rows.append(f"| {rank} | {case['seconds']:.1f} | {cpu_text(case.get('cpu'))} | `{case['id']}` | {what} |")
    return "\n".join(rows)


def per_file(cases: list[dict]) -> dict[str, tuple[float, float | None]]:
    """Each file's wall seconds and CPU-seconds (None where a report has no CPU figures), slowest first."""
    seconds: dict[str, float] = defaultdict(float)
    cpu: dict[str, float | None] = defaultdict(float)
    for case in cases:
        seconds[case["file"]] += case["seconds"]
        cpu[case["file"]] = None if cpu[case["file"]] is None or case.get("cpu") is None else cpu[case["file"]] + case["cpu"]
    return {path: (round(total, 1), cpu[path]) for path, total in sorted(seconds.items(), key=lambda item: -item[1])}


def timeline(cases: list[dict]) -> str:
    """How busy the workers of one report were: its span from the first test's start to the last one's end, each
    worker's busy seconds, and the tail (from when the first worker ran out of tests to the end), with the tests
    still running in it. Empty for a report written without the start times (tests/conftest.py records them)."""
    timed = [case for case in cases if case.get("started") is not None]
    if not timed:
        return ""
    first = min(case["started"] for case in timed)
    end = max(case["started"] + case["seconds"] for case in timed)
    busy: dict[str, float] = defaultdict(float)
    last_end: dict[str, float] = defaultdict(float)
    for case in timed:
        busy[case["worker"]] += case["seconds"]
        last_end[case["worker"]] = max(last_end[case["worker"]], case["started"] + case["seconds"])
    tail_from = min(last_end.values())
    lines = [f"span {(end - first) / 60:.1f} min; each worker's busy minutes: "
             + ", ".join(f"{worker} {seconds / 60:.1f}" for worker, seconds in sorted(busy.items())),
             f"tail: {(end - tail_from) / 60:.1f} min after the first worker ran out of tests, still running then:"]
    for case in sorted(timed, key=lambda c: -(c["started"] + c["seconds"])):
        if case["started"] + case["seconds"] <= tail_from:
            break
        lines.append(f"  {case['worker']} {case['started'] - first:7.0f} s +{case['seconds']:6.1f} s  {case['id']}")
    return "\n".join(lines)


def record(cases: list[dict], floor: float = RECORD_FLOOR) -> dict[str, float]:
    """Each test's seconds, heaviest first, for the tests that took at least `floor` (the rest count 0.1 s)."""
    kept = [case for case in cases if case["seconds"] >= floor]
    return {case["id"]: round(case["seconds"], 1) for case in sorted(kept, key=lambda c: -c["seconds"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.durations", description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="JUnit XML files written by pytest --junitxml")
    parser.add_argument("--top", type=int, default=30, help="how many of the slowest tests to list (default 30)")
    parser.add_argument("--write", type=Path, help="also write each test's seconds to this JSON file "
                        "(tests/durations.json: the order tests/conftest.py hands tests to the workers)")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top {args.top}: give a whole number of tests >= 1, e.g. --top 30")
    missing = [str(report) for report in args.reports if not report.is_file()]
    if missing:
        parser.error(f"no such report: {', '.join(missing)} (pytest --junitxml=FILE writes one; make test-durations runs both halves)")
    cases = []
    for report in args.reports:
        found = read_cases(report)
        cpu = [c["cpu"] for c in found if c.get("cpu") is not None]
        print(f"{report.name}: {len(found)} tests, {sum(c['seconds'] for c in found) / 60:.1f} min of test time"
              + (f", {sum(cpu) / 60:.1f} CPU-min" if cpu else "")
              + f" ({sum(c['outcome'] == 'failed' for c in found)} failed)")
        cases += found
        shown = timeline(found)
        if shown:
            print(shown)
    print()
    print(table(cases, args.top))
    print("\n| file | seconds | CPU-s |\n|---|---:|---:|")
    for path, (seconds, cpu) in list(per_file(cases).items())[:args.top]:
        print(f"| `{path}` | {seconds:.0f} | {cpu_text(cpu)} |")
    if args.write:
        args.write.write_text(json.dumps(record(cases), indent=0) + "\n")
        print(f"\neach test's seconds (those over {RECORD_FLOOR} s): {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
