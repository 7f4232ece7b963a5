"""A paper's headline claim in miniature, read back from MLflow: `python -m analysis.reproduce seedNNN [overrides]`.

`make reproduce-seedNNN` runs the study `+reproduce=seedNNN` (conf/reproduce/) over training seeds, then this:
it reads the study's finished runs (tag `reproduce-seedNNN`), gives each the role it plays in the claim
(`analysis/claims.py`), and writes `reports/reproduce-seedNNN/README.md` in the `out` folder: the paper's claim
with its number, the miniature's numbers with their spread over training seeds, each comparison's paired
difference and the verdict, and a figure (for seed 000: held-out reward against fresh verifier evaluations).
The section is printed too. Overrides are Hydra's (`out=DIR`, `tracking.experiment=NAME`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def check_before_imports(argv: list[str]) -> None:
    """`--help`, `--version`, a reproduction that does not exist and a store without its runs: answered in one
    line before numpy, pandas and MLflow load (the names are conf/reproduce/'s options, as analysis.claims's)."""
    from src.validate.checks import exit_with_message
    from src.command.entry import answer_version, check_runs_there
    from src.paths import CONFIG_DIR

    answer_version(argv, "python -m analysis.reproduce")
    names = sorted(path.stem for path in (CONFIG_DIR / "reproduce").glob("*.yaml"))
    if any(word in ("-h", "--help") for word in argv):
        sys.stdout.write(f"usage: python -m analysis.reproduce {{{','.join(names)}}} [OVERRIDE ...]\n\n{__doc__}")
        sys.exit(0)
    if not argv or argv[0] not in names:
        given = f"'{argv[0]}' is not a reproduction" if argv else "name a reproduction first"
        exit_with_message(f"{given}: choose one of {', '.join(names)} (e.g. python -m analysis.reproduce seed000)")
    name = argv[0]
    check_runs_there([f"+reproduce={name}", *argv[1:]], [f"reproduce-{name}"], hint=f"run make reproduce-{name} first")


if __name__ == "__main__":
    check_before_imports(sys.argv[1:])

import numpy as np  # noqa: E402  (the report's own imports)
import pandas as pd  # noqa: E402
from rich.console import Console  # noqa: E402

from analysis.claims import (CLAIMS, NOT_TESTABLE, UNDECIDED, Claim,  # noqa: E402
                             Study, assign_roles, baseline_learns, commit_refusal, look_levels, verdict)
from analysis.seeds import ALPHA, claim_test  # noqa: E402

console = Console()


def curve_reader(client, protocol: str = "quick"):
    """run_id -> its learning curve: (fresh evaluations, held-out mean reward) at the start, every evaluation
    during training and the end. Training metrics are logged at step s - 1 for the s-th step, evaluations at s."""
    def curve(run_id: str) -> pd.DataFrame:
        fresh = {point.step + 1: point.value for point in client.get_metric_history(run_id, "budget/fresh_evaluations")}
        fresh[0] = 0.0
        points = {}
        for stage in ("start", "during", "final"):
            for point in client.get_metric_history(run_id, f"{protocol}/{stage}/mean_reward"):
                points[point.step] = point.value  # the last value of a step: a resumed run may re-log one
        rows = [{"step": step, "fresh": fresh.get(step, np.nan), "reward": value} for step, value in points.items()]
        return pd.DataFrame(rows, columns=["step", "fresh", "reward"]).sort_values("step").reset_index(drop=True)
    return curve


def history_reader(client):
    """(run_id, metric) -> the value the run logged at each step, in step order (a step logged twice: its last)."""
    def history(run_id: str, metric: str) -> list[float]:
        return [value for _, value in sorted({point.step: point.value
                                              for point in client.get_metric_history(run_id, metric)}.items())]
    return history


def finished_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The newest FINISHED run of each (cell, seed): the reproduction's data points, with a numeric `seed`."""
    done = runs[runs["status"] == "FINISHED"].drop_duplicates("tags.cell_id")
    seeds = pd.to_numeric(done.get("tags.seed", pd.Series("0", index=done.index)), errors="coerce").fillna(0)
    return done.assign(seed=seeds.astype(int)).reset_index(drop=True)


OUTCOME_WORDS = {"agrees": "yes", "against": "no: the claim is rejected", "undecided": "undecided",
                 "no spread": "no spread: no test", "no data": "no data"}


def comparison_table(judged: list[dict], tested: bool = True, level: float = ALPHA,
                     next_look: int | None = None) -> list[str]:
    """One row a comparison: the paired difference, the claim's one-sided test, the smallest difference its seeds
    detect (80 % power at the test's `level`) against the margin, the outcome and what stands in for the paper. Not
    `tested` (fewer seeds than planned and no look: `early_look`), the test's p and outcome are withheld. An
    undecided row names the preset `next_look`, or at the last look the seeds a new study would be planned at."""
    interval = f"{100 * (1 - 2 * level):g} %"
    lines = [f"| comparison | paper | expected (margin) | difference ({interval}, paired) | p (one-sided) "
             "| detectable (80 %) | seeds | agrees | substitution |", "| --- |" + " --- |" * 8]
    for row in judged:
        hw = f" ± {row['diff_hw']:.3f}" if not np.isnan(row["diff_hw"]) else ""
        p = f"{row['p_value']:.3g}" if not np.isnan(row["p_value"]) else "none"
        detect = f"{row['detectable']:.3f}" if not np.isnan(row["detectable"]) else "none"
        agrees = OUTCOME_WORDS[row["outcome"]]
        if row["outcome"] == "undecided":
            agrees += (f" (next look: {next_look} seeds)" if next_look else
                       f" (a new study: {row['seeds_needed'] or 'over 10,000'} seeds)")
        if not tested:
            p, agrees = "withheld", "not tested before the planned seeds"
        lines.append(f"| {row['label']} | {row['paper']} | {row['expect']} ({row['margin']:g}: {row['why']}) | "
                     f"{row['diff']:+.3f}{hw} | {p} | {detect} | {row['n_pairs']} | {agrees} | "
                     f"{row['substitution'] or '-'} |")
    return lines


def role_table(study: Study, metrics: list[str]) -> list[str]:
    lines = ["| role | " + " | ".join(metrics) + " |", "| --- |" + " --- |" * len(metrics)]
    for role in study.runs["role"].drop_duplicates():
        lines.append(f"| {role} | " + " | ".join(study.spread(role, metric) for metric in metrics) + " |")
    return lines


def unplanned_refusal(seeds: int, planned: int) -> str | None:
    """More training seeds than the study was planned for: judging them would be a second look that no preset
    level allows for (optional stopping), so no verdict is given."""
    if seeds <= planned:
        return None
    return (f"runs of {seeds} training seeds, more than the {planned} planned before the runs "
            "(hydra.sweeper.planned_seeds): judge the planned seeds' runs alone (out=DIR of a study run at its plan)")


def early_look(seeds: int, planned: int, looks: tuple[int, ...] = ()) -> str | None:
    """Fewer training seeds than planned, at no preset look: a claim is tested only at its looks (its planned
    count, and a sequential design's interim looks), so these seeds' tests are withheld (a look at 3 seeds and
    another at the plan, each at 5 %, agree falsely in 8.7-9.1 % of null studies, not 5 %)."""
    if seeds >= planned or seeds in looks:
        return None
    if looks:
        at = " and ".join(str(n) for n in (*looks, planned))
        return (f"{seeds} of the {planned} planned training seeds: the claim is tested only at its looks ({at} "
                "seeds), so these seeds' differences are shown and their tests withheld")
    return (f"{seeds} of the {planned} planned training seeds: the claim is tested once, at its planned count, "
            "so these seeds' differences are shown and their tests withheld")


def section(claim: Claim, study: Study, figure: Path | None, command: str) -> str:
    """The report section: claim, our numbers, comparisons, schedule checks, substitutions, verdict, figure and
    the command that made it. Runs of several commits get no verdict, only the line that refuses one; runs of
    fewer seeds than planned are undecided, their tests withheld."""
    levels = look_levels(claim)
    comparisons = claim.compare(study)
    # A look is at the seeds every comparison pairs: a study whose baseline has all its seeds and a method cell
    # few is at the method cell's count, not the baseline's.
    planned, seeds = max(levels), min((c.pairs() for c in comparisons), default=0)
    level = levels.get(seeds, min(levels.values()))  # between looks the tests are withheld: shown at a look's level
    next_look = min((n for n in levels if n > seeds), default=None)
    judged = [{**vars(comparison), **comparison.judged(level)} for comparison in comparisons]
    refused = commit_refusal(study.runs) or unplanned_refusal(study.runs["seed"].nunique(), planned)
    untestable = baseline_learns(study, claim.baseline)
    outcome, reason = ("refused", refused) if refused else (NOT_TESTABLE, untestable) if untestable \
        else verdict(judged, next_look)
    early = early_look(seeds, planned, claim.looks)
    if early and not (refused or untestable):  # a test's outcome, or seeds still to come for one
        outcome, reason = UNDECIDED, early
    metrics = [m for m in ("quick/start/mean_reward", "quick/final/mean_reward", "quick/final/pass_at_1",
                           "budget/fresh_evaluations")
               if "metrics." + m in study.runs]
    lines = [f"## {claim.paper}: {outcome}", "", f"**The paper** (line {claim.source[0]}): {claim.statement}", "",
             f"**The miniature** (`{command}`): {seeds} training seed(s) paired in every comparison, of the "
             f"{planned} planned, {len(study.runs)} finished run(s). Substitutions: " + "; ".join(claim.substitutions) + ".", "",
             *role_table(study, metrics), "",
             *comparison_table(judged, tested=early is None, level=level, next_look=next_look), "",
             f"Tests: {claim_test(level)}; each margin fixed in analysis/claims.py before any run"
             + (f"; a sequential design, tested at {' and '.join(map(str, levels))} seeds, each at {100 * level:g} %"
                if claim.looks else "") + ".", ""]
    lines += [f"- schedule check, not evidence: {check.result()}" for check in claim.checks(study)]
    lines += ["", f"**Verdict: {outcome}.** {reason}.", ""]
    lines += [f"- {note}" for note in claim.notes(study)]
    if figure is not None:
        lines += ["", f"![{claim.name}]({figure.name})"]
    return "\n".join(lines) + "\n"


def plot_curves(study: Study, path: Path) -> Path | None:
    """Held-out reward against fresh verifier evaluations, each role's mean over seeds (thin lines: each seed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    drawn = False
    for index, role in enumerate(study.runs["role"].drop_duplicates()):
        curves = [study.curve(run_id) for run_id in study.of(role)["run_id"]]
        curves = [curve.dropna() for curve in curves if not curve.dropna().empty]
        for curve in curves:
            ax.plot(curve["fresh"], curve["reward"], color=f"C{index}", alpha=0.25, linewidth=0.8)
        if curves:
            mean = pd.concat(curves).groupby("step")[["fresh", "reward"]].mean()
            ax.plot(mean["fresh"], mean["reward"], color=f"C{index}", marker="o", label=f"{role} ({len(curves)} seeds)")
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set(xlabel="fresh verifier evaluations", ylabel="held-out mean reward (quick)",
           title="Seed 000 in miniature: reward against fresh evaluations")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    err = Console(stderr=True, soft_wrap=True)  # each error is one line, however narrow the terminal
    if not argv or argv[0] not in CLAIMS:
        given = f"'{argv[0]}' is not a reproduction" if argv else "name a reproduction first"
        err.print(f"error: {given}: choose one of {', '.join(CLAIMS)} (e.g. python -m analysis.reproduce seed000)",
                  highlight=False, markup=False)
        return 2
    claim, overrides = CLAIMS[argv[0]], argv[1:]
    return report(claim, overrides, err)


def report(claim: Claim, overrides: list[str], err: Console) -> int:
    from hydra import compose, initialize_config_dir
    from mlflow.tracking import MlflowClient

    from analysis.runs import ReportError, load_runs
    from src.paths import CONFIG_DIR, register_root_resolver

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from src.validate.checks import composition_error

    register_root_resolver()
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[f"+reproduce={claim.name}", *overrides])
    except (HydraException, OmegaConfBaseException) as error:
        err.print(f"error: {composition_error(error, overrides)}", highlight=False, markup=False)
        return 2
    sweep, uri = cfg.tracking.sweep, cfg.tracking.uri
    try:
        runs = load_runs(uri, cfg.tracking.experiment, [sweep])
    except ReportError as error:
        err.print(f"error: {error}", highlight=False, markup=False)
        return 1
    runs = finished_runs(runs) if not runs.empty else runs
    if runs.empty:
        err.print(f"error: no finished runs of {sweep} in {uri}: run make reproduce-{claim.name} first",
                  highlight=False, markup=False)
        return 1
    client = MlflowClient(uri)
    study = Study(assign_roles(runs, claim), curve_reader(client), history_reader(client))
    out_dir = Path(cfg.out) / "reports" / sweep
    out_dir.mkdir(parents=True, exist_ok=True)
    figure = plot_curves(study, out_dir / f"{claim.name}-curves.png") if claim.name == "seed000" else None
    text = section(claim, study, figure, f"make reproduce-{claim.name}")
    (out_dir / "README.md").write_text(text)
    sys.stdout.write(text)  # the markdown as written, not wrapped to the terminal's width
    console.print(f"report: {(out_dir / 'README.md').resolve()}", soft_wrap=True, highlight=False)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    sys.exit(main())
