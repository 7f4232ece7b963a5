"""ZIP-RC-Lite report (seed 004 Tables 3-4, Figure 5): read the stage runs back from MLflow, write report.md + PNGs.

    python -m src.ziprc report [overrides]     # reports/ziprc-<name>/report.md

Decode runs are matched by the head's work folder (tag `ziprc.workdir`); for each (meta-policy, seed)
the newest run counts. Table 4 is mean ± std over seeds with cost and latency relative to best-of-N
("none"); the figures are the compute/accuracy and latency/accuracy Pareto plots with the frontier of
the non-dominated operating points.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
from omegaconf import DictConfig


COLOURS = {"none": "black", "prune": "C0", "early_stop": "C1", "utility": "C2"}


def decode_runs(cfg: DictConfig) -> pd.DataFrame:
    """The newest decode run per (meta-policy, seed) of this head's work folder."""
    mlflow.set_tracking_uri(cfg.tracking.uri)
    runs = mlflow.search_runs(experiment_names=[cfg.tracking.experiment],
                              filter_string=f"tags.`ziprc.stage` = 'decode' AND tags.`ziprc.workdir` = "
                                            f"'{Path(cfg.ziprc.workdir)}' AND attributes.status = 'FINISHED'",
                              order_by=["start_time DESC"])
    if runs.empty or "tags.ziprc.policy" not in runs:
        return pd.DataFrame()
    runs = runs[runs["tags.ziprc.policy"].notna()]  # the decode stage's own run holds no operating point
    return runs.drop_duplicates(["tags.ziprc.policy", "tags.ziprc.seed"]).reset_index(drop=True)


def operating_points(runs: pd.DataFrame) -> pd.DataFrame:
    """Table 4: per meta-policy, mean and std over seeds of accuracy, cost and latency, and % change vs none."""
    table = runs.groupby(["tags.ziprc.policy", "tags.ziprc.kind"]).agg(
        seeds=("tags.ziprc.seed", "nunique"),
        accuracy=("metrics.accuracy", "mean"), accuracy_std=("metrics.accuracy", "std"),
        cost=("metrics.cost", "mean"), cost_std=("metrics.cost", "std"),
        latency=("metrics.latency", "mean"), latency_std=("metrics.latency", "std")).reset_index()
    table = table.rename(columns={"tags.ziprc.policy": "policy", "tags.ziprc.kind": "kind"})
    base = table[table["policy"] == "none"]
    for column in ("cost", "latency"):
        table[f"{column}_change"] = (table[column] / base[column].iloc[0] - 1) if not base.empty else np.nan
    table["accuracy_change"] = table["accuracy"] - base["accuracy"].iloc[0] if not base.empty else np.nan
    order = {"none": 0, "prune": 1, "early_stop": 2, "utility": 3}
    return table.sort_values(["kind", "policy"], key=lambda c: c.map(order) if c.name == "kind" else c,
                             kind="stable").reset_index(drop=True)


def pareto_front(x: np.ndarray, y: np.ndarray) -> list[int]:
    """Indices of the points no other point beats (lower x and higher y, one strictly), ordered by x."""
    keep = [i for i in range(len(x)) if not any((x[j] <= x[i] and y[j] >= y[i]) and (x[j] < x[i] or y[j] > y[i])
                                                  for j in range(len(x)))]
    return sorted(keep, key=lambda i: x[i])


def pareto_figure(table: pd.DataFrame, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, axis, name in ((axes[0], "cost", "compute (active forward passes per prompt)"),
                           (axes[1], "latency", "latency (decode steps per prompt)")):
        for _, row in table.iterrows():
            ax.errorbar(row[axis], row["accuracy"], xerr=row[f"{axis}_std"], yerr=row["accuracy_std"], fmt="o",
                        color=COLOURS.get(row["kind"], "gray"), capsize=3, ms=6 if row["kind"] != "none" else 9)
            ax.annotate(row["policy"].replace("early_stop ", "").replace("utility ", ""), (row[axis], row["accuracy"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=7)
        front = pareto_front(table[axis].to_numpy(), table["accuracy"].to_numpy())
        ax.plot(table[axis].to_numpy()[front], table["accuracy"].to_numpy()[front], "k:", lw=1, label="Pareto frontier")
        for kind, colour in COLOURS.items():
            ax.plot([], [], "o", color=colour, label="best-of-N (none)" if kind == "none" else kind)
        ax.set(xlabel=name, ylabel="accuracy (selected by value_end)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("ZIP-RC-Lite live decoder: mean ± std over seeds (seed 004 Figure 5)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _percent(value: float) -> str:
    return "" if pd.isna(value) else f" ({value:+.0%})"


def write_report(cfg: DictConfig) -> Path:
    out = Path(cfg.ziprc.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# ZIP-RC-Lite report: {cfg.ziprc.name}", "",
             f"Policy `{cfg.policy.name_or_path}`, head and data in `{cfg.ziprc.workdir}`, MLflow experiment "
             f"`{cfg.tracking.experiment}` at {cfg.tracking.uri}.", ""]
    score_path = Path(cfg.ziprc.workdir) / "score.json"
    lines += ["## Offline calibration (Table 3) and selection (Table 5)", ""]
    if score_path.is_file():
        import json

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
    else:
        lines.append("_No offline scores yet: `python -m src.ziprc score`._")
    lines += ["", "## Live decoder (Table 4, Figure 5)", ""]
    runs = decode_runs(cfg)
    if runs.empty:
        lines.append("_No decode runs yet: `python -m src.ziprc decode`._")
    else:
        table = operating_points(runs)
        table.to_csv(out / "operating_points.csv", index=False)
        pareto_figure(table, out / "pareto.png")
        lines += ["Cost: active forward passes per prompt (the shared prompt encoding counts once); latency: decode "
                  "steps per prompt; accuracy: the selected (highest value_end) sample is correct. Mean ± std over "
                  "seeds; changes relative to best-of-N (none).", "",
                  "| policy | seeds | accuracy | compute (fwd passes) | latency (decode steps) |",
                  "| --- | --- | --- | --- | --- |"]
        for _, row in table.iterrows():
            lines.append(f"| {row['policy']} | {row['seeds']} | {row['accuracy']:.3f} ± {row['accuracy_std']:.3f} | "
                         f"{row['cost']:.1f} ± {row['cost_std']:.1f}{_percent(row['cost_change'])} | "
                         f"{row['latency']:.1f} ± {row['latency_std']:.1f}{_percent(row['latency_change'])} |")
        lines += ["", "![compute and latency Pareto](pareto.png)"]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
