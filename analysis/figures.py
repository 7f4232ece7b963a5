"""Figures of the report (paper Figures 3-8), each drawn from a table that `analysis.report` builds.

analysis.report draws only the figures its runs can fill and says in report.md which cells the others
need; a function given an empty table still draws a figure that says what is missing. Each figure is
saved twice by `_save`, the one save helper: PNG at 300 dpi (for report.md and
slides) and PDF (vector, for a paper), at the given path and the same path with `.pdf`.

Rows with `plain` False are SPEC 9 variants: they have no (rho, L, c) and are drawn by their
`variant` label (one colour and marker each, the same in every figure), never as grid cells.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display (also on cluster nodes without X)

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.colors import Normalize  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from analysis.tables import format_value  # noqa: E402

BASELINE_COLOR = "black"
MISSING_COLOR = "#d9d9d9"
# Marker per clip ceiling c; other ceilings take the spare markers in order.
C_MARKERS = {1.0: "o", 3.0: "s", 10.0: "^", 1000.0: "X"}
SPARE_MARKERS = ["D", "v", "P", "h", "<", ">"]
L_LINESTYLES = {1: "-", 2: "--", 3: ":"}
# Variant markers: the first four are used by nothing else, so a variant never reads as a clip ceiling.
VARIANT_MARKERS = ["p", "H", "d", "8", "D", "P", "v", "<", ">", "h"]
VARIANT_LINESTYLE = "-."


def _finite(value) -> bool:
    return value is not None and not pd.isna(value) and math.isfinite(float(value))


def _say(ax, text: str) -> None:
    """Write a 'no data' note in the middle of an empty axis."""
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=10, color="dimgray",
            transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


PNG_DPI = 300
FORMATS = ("png", "pdf")


def _save(fig, path: Path) -> Path:
    """Write the figure as `path` (PNG, 300 dpi) and as the same name with `.pdf`; returns the PNG path."""
    path = Path(path).with_suffix(".png")
    for suffix in FORMATS:
        fig.savefig(path.with_suffix(f".{suffix}"), dpi=PNG_DPI, bbox_inches="tight",
                    metadata={"CreationDate": None} if suffix == "pdf" else None)
    plt.close(fig)
    return path


def _integer_steps(ax) -> None:
    """Optimizer steps are whole numbers: no 12.5 tick on a step axis."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _marker(c: float, extra: dict[float, str]) -> str:
    if c in C_MARKERS:
        return C_MARKERS[c]
    if c not in extra:
        extra[c] = SPARE_MARKERS[len(extra) % len(SPARE_MARKERS)]
    return extra[c]


def _palette(values) -> dict:
    """One tab10 colour per distinct value, in sorted order (stable across figures of one report)."""
    cmap = plt.get_cmap("tab10")
    return {value: cmap(i % 10) for i, value in enumerate(sorted(set(values)))}


def _plain(table: pd.DataFrame) -> pd.Series:
    """Which rows are plain grid runs (all of them when the table has no `plain` column)."""
    if "plain" not in table:
        return pd.Series(True, index=table.index)
    return table["plain"].astype(bool)


def _variant_styles(table: pd.DataFrame) -> dict[str, tuple]:
    """(colour, marker) per variant label of the table, in sorted order: stable across figures of one report."""
    labels = table.loc[~_plain(table), "variant"] if "variant" in table else []
    cmap = plt.get_cmap("Dark2")
    return {label: (cmap(i % cmap.N), VARIANT_MARKERS[i % len(VARIANT_MARKERS)])
            for i, label in enumerate(sorted(set(labels)))}


def _frontier_point(ax, row: pd.Series, fmt: str, color, size: int) -> None:
    """One cell on a frontier: its mean with the half-width as error bar; hollow for the quick protocol."""
    hollow = row["protocol"] != "canonical"  # quick-protocol points are hollow: not comparable
    ax.errorbar(row["fresh_evaluations"], row["pass@k_max"],
                yerr=row["pass@k_max_hw"] if _finite(row["pass@k_max_hw"]) else None,
                fmt=fmt, color=color, mfc="none" if hollow else color, ms=size, capsize=3)


def _frontier_panel(ax, replay: pd.DataFrame, baseline: pd.DataFrame, rho_colors: dict, markers: dict,
                    k_label: str) -> None:
    """Replay cells (colour rho, marker c) and the fresh-only star with its dashed level."""
    for _, row in replay.iterrows():
        _frontier_point(ax, row, _marker(row["c"], markers), rho_colors[row["rho"]], 8)
    for _, row in baseline.iterrows():
        _frontier_point(ax, row, "*", BASELINE_COLOR, 16)
        ax.axhline(row["pass@k_max"], color=BASELINE_COLOR, ls="--", lw=1, alpha=0.6)
    ax.set_xlabel("fresh verifier evaluations (count)")
    ax.set_ylabel(f"{k_label} (fraction of held-out prompts)")
    ax.grid(alpha=0.3)


def frontier_sweep(results: pd.DataFrame) -> pd.DataFrame:
    """The evaluated L = 2 grid cells: the frontier's right panel, drawn when it has two or more."""
    points = results[results["pass@k_max"].notna() & results["fresh_evaluations"].notna()]
    return points[_plain(points) & (points["rho"] > 0) & (points["L"] == 2)]


def plot_frontier(results: pd.DataFrame, path: Path, k_label: str) -> Path:
    """Figure 3: pass@k against fresh verifier evaluations: every cell and variant, and (with two or more
    L = 2 cells) a second panel connecting the L = 2 cells of each clip ceiling across replay ratios."""
    points = results[results["pass@k_max"].notna() & results["fresh_evaluations"].notna()]
    sweep = frontier_sweep(results)
    fig, axes = plt.subplots(1, 2 if len(sweep) >= 2 else 1, figsize=(13 if len(sweep) >= 2 else 7, 5),
                             squeeze=False)
    left = axes[0][0]
    if points.empty:
        _say(left, "no finished runs with a final evaluation yet")
        return _save(fig, path)
    plain = _plain(points)
    baseline, replay = points[plain & (points["rho"] == 0)], points[plain & (points["rho"] > 0)]
    variants = points[~plain]
    variant_styles, rho_colors, markers = _variant_styles(results), _palette(replay["rho"]), {}
    _frontier_panel(left, replay, baseline, rho_colors, markers, k_label)
    for _, row in variants.iterrows():  # each variant on its own labelled marker, next to the grid
        color, marker = variant_styles[row["variant"]]
        _frontier_point(left, row, marker, color, 10)
    left.set_title("all cells (colour: ρ, marker: c)" + (" and variants" if not variants.empty else ""))
    if len(sweep) >= 2:
        right = axes[0][1]
        _frontier_panel(right, sweep, baseline, rho_colors, markers, k_label)
        # Connect the L = 2 cells of one clip ceiling across replay ratios: how c interacts with ρ.
        ceilings = sorted(sweep["c"].unique())
        for c, rows in sweep.groupby("c"):
            rows = rows.sort_values("fresh_evaluations")
            right.plot(rows["fresh_evaluations"], rows["pass@k_max"], color="gray", lw=0.8,
                       ls=["-", "--", ":", "-."][ceilings.index(c) % 4])
        right.set_title("L = 2: clip ceiling across replay ratios")
    _frontier_legend(fig, left, points, replay, variants, rho_colors, markers, variant_styles)
    return _save(fig, path)


def _frontier_legend(fig, left, points, replay, variants, rho_colors, markers, variant_styles) -> None:
    """Baseline, rho colours, c markers, one entry per variant; below the panels when there are variants."""
    handles = [Line2D([], [], marker="*", color=BASELINE_COLOR, ls="--", ms=12, label="fresh-only (ρ = 0)")]
    handles += [Line2D([], [], marker="o", color=color, ls="", label=f"ρ = {rho:g}")
                for rho, color in rho_colors.items()]
    handles += [Line2D([], [], marker=_marker(c, markers), color="gray", ls="", label=f"c = {c:g}")
                for c in sorted(replay["c"].dropna().unique())]
    handles += [Line2D([], [], marker=variant_styles[label][1], color=variant_styles[label][0], ls="",
                       ms=9, label=label) for label in sorted(variants["variant"].unique())]
    if (points["protocol"] != "canonical").any():
        handles.append(Line2D([], [], marker="o", color="gray", mfc="none", ls="", label="hollow: quick protocol"))
    if variants.empty:
        left.legend(handles=handles, fontsize=8, loc="best")
    else:  # many labels: below the panels, so no point is hidden (bbox_inches="tight" keeps it in the file)
        fig.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3)


def plot_heatmaps(grid: pd.DataFrame, panels: list[tuple[str, str]], baseline: dict[str, tuple[float, float]],
                  row_label: str, col_label: str, title: str, path: Path) -> Path:
    """Figures 4/5/9: one heatmap panel per metric; missing grid cells hatched grey and labelled 'missing'."""
    rows = sorted(grid["row"].unique())
    cols = sorted(grid["col"].unique())
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 0.9 * len(rows) + 2.6),
                             squeeze=False, layout="constrained")
    for ax, (metric, label) in zip(axes[0], panels):
        values = np.full((len(rows), len(cols)), np.nan)
        for _, cell in grid.iterrows():
            values[rows.index(cell["row"]), cols.index(cell["col"])] = cell.get(metric, np.nan)
        finite = values[np.isfinite(values)]
        ref, ref_hw = baseline.get(metric, (np.nan, np.nan))
        if finite.size and _finite(ref):
            # Diverging map centred on the fresh-only value: blue above the baseline, red below.
            half = max(float(np.abs(finite - ref).max()), 1e-3)
            norm, cmap = Normalize(ref - half, ref + half), plt.get_cmap("RdBu")
        elif finite.size:
            low, high = float(finite.min()), float(finite.max())
            norm, cmap = Normalize(low - 1e-3, high + 1e-3), plt.get_cmap("viridis")
        else:  # nothing to colour: no map and no colourbar, whose 0-1 scale would mean nothing
            norm, cmap = Normalize(0, 1), plt.get_cmap("Greys")
        image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto")
        for _, cell in grid.iterrows():
            i, j = rows.index(cell["row"]), cols.index(cell["col"])
            value = values[i, j]
            if np.isfinite(value):
                text = format_value(value, cell.get(metric + "_hw", np.nan)).replace(" ± ", "\n± ")
                if cell["protocol"] != "canonical":
                    text += f"\n({cell['protocol']})"  # never mix protocols silently
                if cell.get(metric + "_verdict") == "within noise":  # paired t-test over seeds (analysis/seeds.py)
                    text += "\n≈ fresh-only (noise)"
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", ls=":", lw=1.5))
                shade = cmap(norm(value))
                dark = 0.299 * shade[0] + 0.587 * shade[1] + 0.114 * shade[2] < 0.5
                ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
            else:
                # Drawn, never filled or dropped: a grey hatched square that says what is absent.
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=MISSING_COLOR, edgecolor="gray",
                                       hatch="///", lw=0.5))
                why = "no final eval" if not pd.isna(cell["run_id"]) else cell.get("unfinished", "")
                ax.text(j, i, f"missing\n({why})" if why else "missing",
                        ha="center", va="center", fontsize=8, color="black",
                        bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=1))
        ax.set_xticks(range(len(cols)), [f"{col_label} = {c:g}" for c in cols])
        ax.set_yticks(range(len(rows)), [f"{row_label} = {r:g}" for r in rows])
        reference = f"fresh-only {format_value(ref, ref_hw)}" if _finite(ref) else "fresh-only: no run"
        ax.set_title(f"{label}\n{reference}", fontsize=10)
        ax.set_xlabel(f"importance-weight ceiling {col_label}")
        ax.set_ylabel({"ρ": "replay ratio ρ (reused per fresh group)", "L": "max age L (steps)"}.get(row_label, row_label))
        if finite.size:
            fig.colorbar(image, ax=ax, shrink=0.9, label=label)
    if grid["run_id"].isna().all():
        title += "  (no finished runs in this grid yet)"
    fig.suptitle(title)
    return _save(fig, path)


def plot_best_of_n(table: pd.DataFrame, ks: list[int], path: Path, hint: str) -> Path:
    """Figure 6: probe pass@k against k (log2 axis), one line per cell, fresh-only in black."""
    fig, ax = plt.subplots(figsize=(7.5, 5))
    if table.empty:
        _say(ax, hint)
        return _save(fig, path)
    colors = _palette(table["cell"])
    for _, row in table.iterrows():
        present = [k for k in ks if _finite(row.get(f"pass@{k}"))]
        means = [row[f"pass@{k}"] for k in present]
        errors = [row.get(f"pass@{k}_hw") if _finite(row.get(f"pass@{k}_hw")) else 0.0 for k in present]
        baseline = row["rho"] == 0  # NaN for variants: a rho = 0 variant is no baseline
        plain = row.get("plain", True)
        ax.errorbar(present, means, yerr=errors, marker="*" if baseline else "o", capsize=3,
                    color=BASELINE_COLOR if baseline else colors[row["cell"]], ls="--" if baseline else "-",
                    label=f"{row['cell']} {row['coordinates']}" if plain else f"{row['cell']} ({row['variant']})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k (samples per prompt)")
    ax.set_ylabel("pass@k (fraction of prompts, unbiased, probe)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


DYNAMICS_PANELS = [
    ("train/reward", "training reward"),
    ("weights/clip_fraction", "clip fraction (reused responses)"),
    ("weights/ess", "normalised ESS (reused responses)"),
    ("train/kl_per_token", "KL to reference per token"),
]
# The y-axis label (with its unit) of each dynamics panel.
DYNAMICS_UNITS = {
    "train/reward": "mean verifier reward (0-1)",
    "weights/clip_fraction": "fraction of reused responses clipped",
    "weights/ess": "ESS / n (0-1)",
    "train/kl_per_token": "KL (nats per token)",
}


def dynamics_panels(history: pd.DataFrame) -> list[tuple[str, str]]:
    """The Figure 7 panels (key, title) that some run of the history logged: the others are left out."""
    logged = set(history["key"]) if not history.empty else set()
    return [(key, label) for key, label in DYNAMICS_PANELS if key in logged]


def plot_dynamics(history: pd.DataFrame, runs: pd.DataFrame, path: Path) -> Path:
    """Figure 7: per-step training signals, one line per run, colour by c, fresh-only black, variants dash-dotted.

    Only the panels some run logged are drawn (`dynamics_panels`). A history with `low` and `high` columns
    (analysis.seeds.seed_bands: a cell's mean over training seeds) also gets a shaded min-max band across seeds.
    """
    panels = dynamics_panels(history) or DYNAMICS_PANELS[:1]
    columns = 2 if len(panels) > 1 else 1
    rows_count = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows_count, columns, figsize=(6.5 * columns, 4.25 * rows_count + 0.5), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    plain = _plain(runs)
    c_colors = _palette(runs.loc[plain & (runs["rho"] > 0), "c"].dropna())
    variant_styles = _variant_styles(runs)
    drawn_styles: set[tuple] = set()
    for ax, (key, label) in zip(axes.flat, panels):
        ax.set_title(label)
        drawn = 0
        for index, run in runs.iterrows():
            rows = history[(history["run_id"] == run["run_id"]) & (history["key"] == key)] \
                if not history.empty else history
            if rows.empty:
                continue
            _dynamics_line(ax, rows, run, plain[index], c_colors, variant_styles)
            drawn += 1
            drawn_styles.update(_dynamics_styles(run, plain[index]))
        if not drawn:
            _say(ax, f"no '{key}' history")
            continue
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(DYNAMICS_UNITS.get(key, key))
        _integer_steps(ax)
        ax.grid(alpha=0.3)
    _dynamics_legend(fig, drawn_styles, c_colors, variant_styles)
    if history.empty:
        fig.suptitle("no per-step metrics found for the runs in this report")
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    return _save(fig, path)


def _dynamics_line(ax, rows: pd.DataFrame, run: pd.Series, plain: bool, c_colors: dict, variant_styles: dict) -> None:
    """One cell's curve: variants dash-dotted in their colour, fresh-only black, replay coloured by c, styled by L."""
    if not plain:
        color, style, label = variant_styles[run["variant"]][0], VARIANT_LINESTYLE, run["variant"]
    elif run["rho"] == 0:
        color, style, label = BASELINE_COLOR, "-", run["cell"]
    else:
        color, style, label = c_colors[run["c"]], L_LINESTYLES.get(run["L"], "-."), run["cell"]
    ax.plot(rows["step"], rows["value"], lw=1.2, color=color, ls=style, label=label)
    if "low" in rows and (rows["high"] > rows["low"]).any():  # a cell over training seeds: min-max band
        ax.fill_between(rows["step"], rows["low"], rows["high"], color=color, alpha=0.15, lw=0)


def _dynamics_legend(fig, drawn_styles: set[tuple], c_colors: dict, variant_styles: dict) -> None:
    """A legend entry only for what some panel drew: no entry without its series."""
    handles = [Line2D([], [], color=BASELINE_COLOR, label="fresh-only")] if ("baseline",) in drawn_styles else []
    handles += [Line2D([], [], color=color, label=f"c = {c:g}") for c, color in c_colors.items()
                if ("c", c) in drawn_styles]
    handles += [Line2D([], [], color="gray", ls=ls, label=f"L = {L}") for L, ls in L_LINESTYLES.items()
                if ("L", L) in drawn_styles]
    handles += [Line2D([], [], color=color, ls=VARIANT_LINESTYLE, label=label)
                for label, (color, _) in variant_styles.items() if ("variant", label) in drawn_styles]
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=9)


def _dynamics_styles(run: pd.Series, plain: bool) -> set[tuple]:
    """The legend entries a drawn run stands for: its variant, the baseline, or its c and its L."""
    if not plain:
        return {("variant", run["variant"])}
    if run["rho"] == 0:
        return {("baseline",)}
    return {("c", run["c"]), ("L", run["L"])}


def plot_diversity(results: pd.DataFrame, path: Path) -> Path:
    """Figure 8: answer-span unique rate by cell, error bars from the half-widths."""
    rows = results[results["unique_rate"].notna()] if "unique_rate" in results else results.iloc[0:0]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(rows) + 2), 4.8))
    if rows.empty:
        _say(ax, "no unique_rate in any final evaluation yet")
        return _save(fig, path)
    plain = _plain(rows)
    c_colors = _palette(rows.loc[plain & (rows["rho"] > 0), "c"])
    variant_styles = _variant_styles(results)
    colors = [variant_styles[row["variant"]][0] if not plain[index] else "dimgray" if row["rho"] == 0
              else c_colors[row["c"]] for index, row in rows.iterrows()]
    errors = [hw if _finite(hw) else 0.0 for hw in rows["unique_rate_hw"]]
    x = np.arange(len(rows))
    bars = ax.bar(x, rows["unique_rate"], yerr=errors, color=colors, capsize=3)
    for bar, protocol in zip(bars, rows["protocol"]):
        if protocol != "canonical":
            bar.set_hatch("//")  # quick-protocol values hatched: fewer samples, not comparable
    labels = [f"{cell}\n({protocol})" if protocol != "canonical" else cell
              for cell, protocol in zip(rows["cell"], rows["protocol"])]
    ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("answer-span unique rate (distinct answers / samples)")
    ax.set_title("answer-span diversity by cell (colour: c, fresh-only grey"
                 + (", variants in their own colours" if variant_styles else "") + ")")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


FAILURE_COLORS = {"format_error": "#4c72b0", "wrong_target": "#dd8452", "invalid_number_use": "#55a868",
                  "arithmetic_error": "#c44e52", "repetitive_or_incoherent": "#8172b3", "other": "#937860"}


def _failure_labels(table: pd.DataFrame) -> list[str]:
    return [f"{method}\n{cell} ({stage}, {protocol})" for method, cell, stage, protocol
            in zip(table["method"], table["cell"], table["stage"], table["protocol"])]


def plot_failure_shares(table: pd.DataFrame, labels: dict[str, str], path: Path) -> Path:
    """Seed 004 Figure 3: each method's failed rollouts split by dominant category (shares sum to 1)."""
    fig, ax = plt.subplots(figsize=(9.0, max(3.0, 0.6 * len(table) + 1.5)))
    rows = table[table["failed"] > 0] if not table.empty else table
    if rows.empty:
        _say(ax, "no failure taxonomy in any evaluation yet")
        return _save(fig, path)
    y = np.arange(len(rows))[::-1]
    left = np.zeros(len(rows))
    for index, (category, label) in enumerate((c, l) for c, l in labels.items() if f"share_{c}" in rows):
        share = rows[f"share_{category}"].fillna(0.0).to_numpy()
        ax.barh(y, share, left=left, color=FAILURE_COLORS.get(category, f"C{index}"), label=label)
        left += share
    ax.set_yticks(y, _failure_labels(rows), fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of failed rollouts")
    ax.set_title("failure categories, normalised by failed rollouts (seed 004 Fig. 3)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize=8)
    return _save(fig, path)


def plot_failure_totals(table: pd.DataFrame, path: Path) -> Path:
    """Seed 004 Figure 4: failed rollouts per method (per evaluation repeat), annotated with the failed share."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(table) + 2), 4.8))
    if table.empty:
        _say(ax, "no failure taxonomy in any evaluation yet")
        return _save(fig, path)
    x = np.arange(len(table))
    bars = ax.bar(x, table["failed"], color="dimgray")
    for bar, failed, rollouts in zip(bars, table["failed"], table["rollouts"]):
        ax.annotate(f"{failed:g} / {rollouts:g}\n({failed / rollouts:.0%})", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, _failure_labels(table), rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("failed rollouts per evaluation repeat")
    ax.set_title("total failed rollouts by method (seed 004 Fig. 4)")
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.2)
    return _save(fig, path)


def plot_compute_frontier(cells: pd.DataFrame, axes_spec: list[tuple[str, str, str]], path: Path,
                          k_label: str) -> Path:
    """The budget frontier against each cost in `axes_spec` (column, axis label, note when absent): one panel each.

    One point per cell (its mean over training seeds, error bar the half-width), labelled by the cell;
    fresh-only black stars, replay cells coloured by rho, variants in their own colour.
    """
    fig, axes = plt.subplots(1, len(axes_spec), figsize=(6 * len(axes_spec), 4.8), squeeze=False)
    plain = _plain(cells) if not cells.empty else pd.Series(dtype=bool)
    rho_colors = _palette(cells.loc[plain & (cells["rho"] > 0), "rho"]) if not cells.empty else {}
    variant_styles = _variant_styles(cells) if not cells.empty else {}
    for ax, (column, label, absent) in zip(axes[0], axes_spec):
        points = cells[cells[column].notna() & cells["pass@k_max"].notna()] if column in cells else cells.iloc[:0]
        if points.empty:
            _say(ax, absent)
            continue
        for index, row in points.iterrows():
            if not plain[index]:
                color, marker = variant_styles[row["variant"]]
            elif row["rho"] == 0:
                color, marker = BASELINE_COLOR, "*"
            else:
                color, marker = rho_colors[row["rho"]], _marker(row["c"], {})
            ax.errorbar(row[column], row["pass@k_max"],
                        yerr=row["pass@k_max_hw"] if _finite(row["pass@k_max_hw"]) else None,
                        fmt=marker, color=color, ms=12 if marker == "*" else 8, capsize=3)
            ax.annotate(row["cell"], (row[column], row["pass@k_max"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
        ax.set_xlabel(label)
        ax.set_ylabel(k_label)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)
