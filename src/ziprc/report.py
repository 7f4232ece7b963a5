"""ZIP-RC-Lite report (seed 004 Tables 3-4, Figure 5): read the stage runs back from MLflow, write report.md + PNGs.

    python -m src.ziprc report [overrides]     # reports/ziprc-<name>/report.md

Decode runs are matched by the head's work folder (tag `ziprc.workdir`); for each (meta-policy, split,
seed) the newest run counts. The report judges every operating point by the compute best-of-N needs
for the same accuracy: best-of-n for n = 1..K comes from the best-of-N decode's own samples (exact
means over their n-subsets, `metrics.best_of_n`), and `metrics.matched_cost` reads the compute at an
accuracy off that curve. Each meta-policy's setting (tau, beta, the prune threshold) is chosen on the
tuning prompts (split `tune`) by that saving and reported on the held-out prompts (split `report`),
next to the always-prune and random-V-hat controls.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
from omegaconf import DictConfig

from src.ziprc import metrics

COLOURS = {"none": "black", "prune": "C0", "early_stop": "C1", "utility": "C2"}
KIND_ORDER = {"none": 0, "prune": 1, "early_stop": 2, "utility": 3}
RANDOM = " (random V-hat)"


def decode_runs(cfg: DictConfig) -> pd.DataFrame:
    """The newest decode run per (meta-policy, split, seed) of this head's work folder."""
    mlflow.set_tracking_uri(cfg.tracking.uri)
    runs = mlflow.search_runs(experiment_names=[cfg.tracking.experiment],
                              filter_string=f"tags.`ziprc.stage` = 'decode' AND tags.`ziprc.workdir` = "
                                            f"'{Path(cfg.ziprc.workdir)}' AND attributes.status = 'FINISHED'",
                              order_by=["start_time DESC"])
    if runs.empty or "tags.ziprc.policy" not in runs:
        return pd.DataFrame()
    runs = runs[runs["tags.ziprc.policy"].notna()]  # the decode stage's own run holds no operating point
    runs = _with_defaults(runs)
    return runs.drop_duplicates(["tags.ziprc.policy", "tags.ziprc.split", "tags.ziprc.seed"]).reset_index(drop=True)


def _with_defaults(runs: pd.DataFrame) -> pd.DataFrame:
    """Runs logged before the tuning split and the controls existed: reported prompts, the head's V-hat."""
    runs = runs.copy()
    for column, default in (("tags.ziprc.split", "report"), ("tags.ziprc.values", "head")):
        runs[column] = runs[column].fillna(default) if column in runs else default
    return runs


def operating_points(runs: pd.DataFrame) -> pd.DataFrame:
    """Table 4: per split and meta-policy, mean and std over seeds of accuracy, cost and latency, and the change
    against best-of-N (none) on the same split."""
    runs = _with_defaults(runs)
    table = runs.groupby(["tags.ziprc.split", "tags.ziprc.policy", "tags.ziprc.kind", "tags.ziprc.values"]).agg(
        seeds=("tags.ziprc.seed", "nunique"),
        accuracy=("metrics.accuracy", "mean"), accuracy_std=("metrics.accuracy", "std"),
        cost=("metrics.cost", "mean"), cost_std=("metrics.cost", "std"),
        latency=("metrics.latency", "mean"), latency_std=("metrics.latency", "std")).reset_index()
    table.columns = ["split", "policy", "kind", "values", *table.columns[4:]]
    for split, rows in table.groupby("split"):
        base = rows[rows["policy"] == "none"]
        for column in ("cost", "latency"):
            table.loc[rows.index, f"{column}_change"] = (rows[column] / base[column].iloc[0] - 1
                                                         if not base.empty else np.nan)
        table.loc[rows.index, "accuracy_change"] = rows["accuracy"] - base["accuracy"].iloc[0] if not base.empty \
            else np.nan
    return table.sort_values(["split", "kind", "values", "policy"], key=lambda c: c.map(KIND_ORDER)
                             if c.name == "kind" else c, kind="stable").reset_index(drop=True)


def best_of_n_curve(runs: pd.DataFrame) -> pd.DataFrame:
    """Best-of-n for n = 1..K per split, the mean over seeds of what each best-of-N decode logged."""
    runs = _with_defaults(runs)
    rows = []
    for split, none in runs[runs["tags.ziprc.policy"] == "none"].groupby("tags.ziprc.split"):
        n = 1
        while f"metrics.bon_accuracy_n{n}" in none and none[f"metrics.bon_accuracy_n{n}"].notna().any():
            rows.append({"split": split, "n": n, **{name: none[f"metrics.bon_{name}_n{n}"].mean()
                                                     for name in ("accuracy", "cost", "latency")}})
            n += 1
    return pd.DataFrame(rows, columns=["split", "n", "accuracy", "cost", "latency"])


def with_matched_savings(table: pd.DataFrame, curve: pd.DataFrame) -> pd.DataFrame:
    """Add the compute best-of-N needs for each point's accuracy on its split, and the saving against it
    (NaN where the point is more accurate than any best-of-n)."""
    table = table.copy()
    table["bon_cost"] = [metrics.matched_cost(list(zip(curve.loc[curve["split"] == split, "cost"],
                                                       curve.loc[curve["split"] == split, "accuracy"])), accuracy)
                         for split, accuracy in zip(table["split"], table["accuracy"])]
    table["saving"] = 1 - table["cost"] / table["bon_cost"]
    return table


def family(policy: str) -> str | None:
    """The sweep an operating point belongs to ('prune', 'early_stop', 'utility'); None for best-of-N and controls."""
    if policy.endswith(RANDOM) or policy in ("none", "always-prune"):
        return None
    return policy.split(" ")[0]


def choose_on_tune(table: pd.DataFrame) -> dict[str, str]:
    """Per sweep, the setting with the largest saving at matched accuracy on the tuning prompts (more accurate
    than every best-of-n counts as the largest; ties: less compute)."""
    tune = table[table["split"] == "tune"]
    chosen = {}
    for name, rows in tune.groupby(tune["policy"].map(family)):
        ranked = rows.assign(score=rows["saving"].fillna(np.inf)).sort_values(["score", "cost"],
                                                                               ascending=[False, True])
        chosen[name] = ranked["policy"].iloc[0]
    return chosen


def pareto_front(x: np.ndarray, y: np.ndarray) -> list[int]:
    """Indices of the points no other point beats (lower x and higher y, one strictly), ordered by x."""
    keep = [i for i in range(len(x)) if not any((x[j] <= x[i] and y[j] >= y[i]) and (x[j] < x[i] or y[j] > y[i])
                                                  for j in range(len(x)))]
    return sorted(keep, key=lambda i: x[i])


def pareto_figure(table: pd.DataFrame, curve: pd.DataFrame, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, axis, name in ((axes[0], "cost", "compute (active forward passes per prompt)"),
                           (axes[1], "latency", "latency (decode steps per prompt)")):
        for _, row in table.iterrows():
            ax.errorbar(row[axis], row["accuracy"], xerr=row[f"{axis}_std"], yerr=row["accuracy_std"],
                        fmt="x" if row["values"] == "random" else "o", color=COLOURS.get(row["kind"], "gray"),
                        capsize=3, ms=6 if row["kind"] != "none" else 9)
            ax.annotate(row["policy"].replace("early_stop ", "").replace("utility ", "").replace(RANDOM, " rnd"),
                        (row[axis], row["accuracy"]), textcoords="offset points", xytext=(4, 4), fontsize=6)
        if not curve.empty:
            ax.plot(curve[axis], curve["accuracy"], "k--", lw=1, marker=".", label="best-of-n, n = 1..K")
        front = pareto_front(table[axis].to_numpy(), table["accuracy"].to_numpy())
        ax.plot(table[axis].to_numpy()[front], table["accuracy"].to_numpy()[front], "k:", lw=1, label="Pareto frontier")
        for kind, colour in COLOURS.items():
            ax.plot([], [], "o", color=colour, label="best-of-N (none)" if kind == "none" else kind)
        ax.plot([], [], "x", color="gray", label="random V-hat control")
        ax.set(xlabel=name, ylabel="accuracy (the answer is correct)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("ZIP-RC-Lite live decoder on the reported prompts: mean ± std over seeds (seed 004 Figure 5)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _percent(value: float) -> str:
    return "" if pd.isna(value) else f" ({value:+.0%})"


def _matched(row: pd.Series) -> str:
    """'<best-of-N compute at this accuracy> | <compute saved against it>' as two table cells."""
    if pd.isna(row["bon_cost"]):
        return "above every n | -"
    return f"{row['bon_cost']:.1f} | {row['saving']:.0%}"


def _offline_lines(cfg: DictConfig, out: Path) -> list[str]:
    import json

    lines = ["## Offline calibration (Table 3) and selection (Table 5)", ""]
    score_path = Path(cfg.ziprc.workdir) / "score.json"
    if not score_path.is_file():
        return lines + ["_No offline scores yet: `python -m src.ziprc score`._"]
    s = json.loads(score_path.read_text())
    lines += ["| metric | value |", "| --- | --- |"]
    for key, name in (("mean_total_variation", "mean total variation at the prompt (lower is better)"),
                      ("end_f1", "end-of-generation reward F1"), ("end_accuracy", "end-of-generation accuracy"),
                      ("auc_value_end", "AUC(value_end -> correct)"), ("auc_prompt_value", "AUC(V-hat(x) -> correct)"),
                      ("random_at_k", "random@K"), ("value_at_k", "value@K"), ("oracle_at_k", "oracle@K"),
                      ("uniform_k_pass", "pass with uniform K (adaptive-K diagnostic)"),
                      ("adaptive_k_pass", "pass with adaptive K by percentile rank of V-hat(x)"),
                      ("prompt_value_rank_corr", "rank correlation of V-hat(x) with the prompt's pass rate")):
        lines.append(f"| {name} | {s.get(key, float('nan')):.3f} |")
    if (Path(cfg.ziprc.workdir) / "calibration.png").is_file():
        shutil.copy(Path(cfg.ziprc.workdir) / "calibration.png", out / "calibration.png")
        lines += ["", "![calibration](calibration.png)"]
    return lines


def _points_lines(report: pd.DataFrame, chosen: dict[str, str]) -> list[str]:
    lines = ["Accuracy: the answer (the committed sample for early stop, else the best finished value_end) is "
             "correct. Compute: active forward passes per prompt (the shared prompt encoding counts once); latency: "
             "decode steps per prompt. Mean ± std over seeds; compute and latency changes against best-of-N with all "
             "K samples. The last two columns read the best-of-n curve below at the point's accuracy: the compute "
             "best-of-n needs for it, and the share of that compute the point saves (negative: best-of-n gets there "
             "cheaper).", "",
             "| policy | seeds | accuracy | compute (fwd passes) | latency (decode steps) | best-of-n compute at "
             "this accuracy | compute saved at matched accuracy |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for _, row in report.iterrows():
        mark = " (chosen on tune)" if row["policy"] in chosen.values() else ""
        lines.append(f"| {row['policy']}{mark} | {row['seeds']} | {row['accuracy']:.3f} ± {row['accuracy_std']:.3f} | "
                     f"{row['cost']:.1f} ± {row['cost_std']:.1f}{_percent(row['cost_change'])} | "
                     f"{row['latency']:.1f} ± {row['latency_std']:.1f}{_percent(row['latency_change'])} | "
                     f"{_matched(row)} |")
    return lines


def _chosen_lines(table: pd.DataFrame, chosen: dict[str, str]) -> list[str]:
    if not chosen:
        return ["_Nothing chosen: no sweep (prune thresholds, tau, beta) was decoded on tuning prompts "
                "(`ziprc.decode.tune_prompts` > 0)._"]
    lines = ["Each sweep's setting is the one that saves most compute at matched accuracy on the tuning prompts; "
             "its numbers below are those of the reported prompts, next to the controls at the same setting.", "",
             "| sweep | chosen on tune | tune: accuracy, saved | reported: accuracy, compute, saved | random V-hat "
             "at the same setting: accuracy, compute, saved |", "| --- | --- | --- | --- | --- |"]
    by = table.set_index(["split", "policy"])
    for name, policy in chosen.items():
        cells = []
        for split, label in (("tune", policy), ("report", policy), ("report", policy + RANDOM)):
            if (split, label) not in by.index:
                cells.append("not decoded")
                continue
            row = by.loc[(split, label)]
            saved = "above every n" if pd.isna(row["bon_cost"]) else f"{row['saving']:.0%}"
            cells.append(f"{row['accuracy']:.3f}, {saved}" if split == "tune" and label == policy else
                         f"{row['accuracy']:.3f}, {row['cost']:.1f}, {saved}")
        lines.append(f"| {name} | {policy} | {' | '.join(cells)} |")
    return lines


def _curve_lines(curve: pd.DataFrame) -> list[str]:
    lines = ["| n | reported: accuracy | compute | latency | tune: accuracy | compute |",
             "| --- | --- | --- | --- | --- | --- |"]
    by = curve.set_index(["split", "n"])
    for n in sorted(curve["n"].unique()):
        report = by.loc[("report", n)] if ("report", n) in by.index else None
        tune = by.loc[("tune", n)] if ("tune", n) in by.index else None
        cells = [f"{report['accuracy']:.3f} | {report['cost']:.1f} | {report['latency']:.1f}" if report is not None
                 else "- | - | -", f"{tune['accuracy']:.3f} | {tune['cost']:.1f}" if tune is not None else "- | -"]
        lines.append(f"| {n} | {' | '.join(cells)} |")
    return lines


def write_report(cfg: DictConfig) -> Path:
    out = Path(cfg.ziprc.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# ZIP-RC-Lite report: {cfg.ziprc.name}", "",
             f"Policy `{cfg.policy.name_or_path}`, head and data in `{cfg.ziprc.workdir}`, MLflow experiment "
             f"`{cfg.tracking.experiment}` at {cfg.tracking.uri}.", "", *_offline_lines(cfg, out), "",
             "## Live decoder (Table 4, Figure 5)", ""]
    runs = decode_runs(cfg)
    if runs.empty:
        lines.append("_No decode runs yet: `python -m src.ziprc decode`._")
    else:
        curve = best_of_n_curve(runs)
        table = with_matched_savings(operating_points(runs), curve)
        chosen = choose_on_tune(table)
        table.to_csv(out / "operating_points.csv", index=False)
        curve.to_csv(out / "best_of_n.csv", index=False)
        report = table[table["split"] == "report"]
        pareto_figure(report, curve[curve["split"] == "report"], out / "pareto.png")
        lines += ["### Operating points on the reported (held-out) prompts", "", *_points_lines(report, chosen), "",
                  "### Settings chosen on the tuning prompts, with the controls", "", *_chosen_lines(table, chosen),
                  "", "### Best-of-n from the best-of-N decode's own samples (mean over n-subsets)", "",
                  *_curve_lines(curve), "", "![compute and latency Pareto](pareto.png)"]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
