"""What the suite checks: the line coverage of each tree by `make test`, held against its floor, and the two
counts that say nothing moved out of it (commands tested as typed, tests left to `make test-long`).

    python -m tests.coverage_floor DATA_DIR [--root DIR] [--floor FILE] [--record] [--long LIST ...]

combines the coverage.py data files in DATA_DIR (one per process that `make coverage` measured), counts the
statements of every Python file under src/, analysis/, launch/ and hydra_plugins/ of --root (default: this
checkout) and the ones the suite ran, prints a line per tree and the total, and exits 1 if a tree's coverage
fell below tests/coverage_floor.json. A file the suite never imported counts with all its lines missed. It also
counts the documented commands tests/commands/test_commands.py runs as typed (no fewer than the floor's) and,
from `--long` lists (`pytest --collect-only -q -m long` in each environment), the tests marked `long` (no more
than the floor's). `--record` writes today's coverage as the new floor (after a change that adds tested code).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("src", "analysis", "launch", "hydra_plugins")
FLOOR = Path(__file__).with_name("coverage_floor.json")


def measure(data_dir: Path, root: Path) -> dict[str, dict[str, int]]:
    """{tree: {"statements": n, "covered": n}} from the data files in data_dir."""
    import coverage

    files = sorted(str(path) for path in data_dir.glob(".coverage*") if path.is_file())
    if not files:
        raise SystemExit(f"no coverage data in {data_dir}: run `make coverage` first")
    cov = coverage.Coverage(data_file=str(data_dir / ".combined"), config_file=False)
    cov.combine(files, keep=True)
    cov.save()
    figures = {}
    for tree in TREES:
        statements = covered = 0
        for path in sorted((root / tree).rglob("*.py")):
            _, lines, _, missing, _ = cov.analysis2(str(path))
            statements += len(lines)
            covered += len(lines) - len(missing)
        figures[tree] = {"statements": statements, "covered": covered}
    return figures


def long_tests(lists: list[Path]) -> int:
    """The distinct test ids in `pytest --collect-only -q` listings (one environment each)."""
    return len({line.strip() for path in lists for line in path.read_text().splitlines() if "::" in line})


def documented_commands() -> int:
    from tests.commands.test_commands import DOCUMENTED

    return len(DOCUMENTED)


def counts_hold(floor: dict, long_lists: list[Path]) -> list[str]:
    """Print the two counts against the floor; the names of those that moved the wrong way."""
    moved = []
    documented = documented_commands()
    least = floor.get("documented_commands_at_least", 0)
    print(f"{'as typed':14s} {documented} documented commands tested as typed (at least {least})")
    if documented < least:
        moved.append("commands tested as typed")
    if long_lists:
        count, most = long_tests(long_lists), floor.get("long_tests_at_most")
        print(f"{'long':14s} {count} tests marked long, left to make test-long (at most {most})")
        if most is not None and count > most:
            moved.append("tests moved to long")
    return moved


def percent(figure: dict[str, int]) -> float:
    return 100.0 * figure["covered"] / max(figure["statements"], 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.coverage_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("data_dir", type=Path, help="the folder of coverage data files (make coverage: .coverage-data)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose trees were measured")
    parser.add_argument("--record", action="store_true", help="write today's figures as the floor")
    parser.add_argument("--floor", type=Path, default=FLOOR, help="the floor's file (default tests/coverage_floor.json)")
    parser.add_argument("--long", type=Path, nargs="*", default=[], metavar="LIST",
                        help="pytest --collect-only -q -m long listings, one per environment")
    args = parser.parse_args(argv)
    if not args.data_dir.is_dir():
        parser.error(f"{args.data_dir}: no such folder (make coverage writes .coverage-data)")
    figures = measure(args.data_dir, args.root.resolve())
    floor = json.loads(args.floor.read_text()) if args.floor.is_file() else {}
    total = {key: sum(figure[key] for figure in figures.values()) for key in ("statements", "covered")}
    fell = []
    for tree, figure in {**figures, "total": total}.items():
        known = floor.get(tree)
        against = f"  (floor {percent(known):.1f} %, {known['covered']} lines)" if known else ""
        print(f"{tree:14s} {percent(figure):5.1f} %  {figure['covered']:6d} of {figure['statements']:6d} lines{against}")
        if known and round(percent(figure), 1) < round(percent(known), 1):
            fell.append(tree)
    fell += counts_hold(floor, args.long)
    if args.record:
        kept = {key: value for key, value in floor.items() if key.endswith(("_at_least", "_at_most"))}
        args.floor.write_text(json.dumps({**figures, "total": total, **kept}, indent=1) + "\n")
        print(f"recorded as the floor: {args.floor}")
    elif fell:
        print(f"below the floor: {', '.join(fell)}: a check the suite made is gone", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
