"""report.md: one section per table or figure, written from the report's tables (analysis.tables.ReportData).

A figure the report's runs cannot fill is left out (analysis.report decides) and its section says, in
one line, which cells or logs it needs instead of showing an empty panel.
"""

from __future__ import annotations

from datetime import datetime

import numpy as np
import pandas as pd

from analysis import compute, seeds
from analysis.runs import protocol_order
from analysis.tables import (FAILURE_CATEGORIES, FAILURE_LABELS, GRIDS, VARIANT_STUDY, ReportData, format_count, format_integer, format_ratio,
                             format_seconds, format_value, missing_cells, results_cells, same_label_configs, top_k)

QUOTE_CHARS = 600  # a quoted response longer than this is cut (the run's table has it whole)
PROMPT_CHARS = 200  # the end of the prompt: the task, after the shared instructions


def probe_hint(sweeps: list[str] | None) -> str:
    """What to run for the best-of-N probe: `src.eval.standalone` needs the runs named (--sweep or --run)."""
    target = " ".join(f"--sweep {sweep}" for sweep in sweeps) if sweeps else "--run <run id>"
    return ("no probe results yet: run the best-of-N probe on this report's runs,\n"
            f"python -m src.eval {target} evaluation=probe\n(it logs probe/final/pass_at_<k> into each run)")


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured markdown table ('|' inside cells escaped)."""
    def line(cells) -> str:
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers)), *(line(row) for row in rows)])


def figure_lines(name: str, alt: str, caption: str, left_out: str | None = None) -> list[str]:
    """A figure in report.md (the PNG, then its caption with a link to the PDF), or the line saying why not."""
    if left_out:
        return [f"_Figure left out: {left_out}._"]
    return [f"![{alt}]({name}.png)", "", f"*{caption}* ([PDF]({name}.pdf))"]


def when(value) -> str:
    """A run's start in local time, the clock `--since` reads."""
    if value is None or pd.isna(value):
        return "-"
    stamp = pd.Timestamp(value)
    if stamp.tzinfo is not None:
        stamp = stamp.tz_convert(datetime.now().astimezone().tzinfo)
    return stamp.strftime("%Y-%m-%d %H:%M")


def report_markdown(data: ReportData, left_out: dict[str, str], *, title: str, source: str,
                    sweeps: list[str] | None) -> str:
    """The whole report.md; `left_out` maps each figure not drawn to the reason its section prints."""
    out = [f"# {title}", "", f"Generated {datetime.now():%Y-%m-%d %H:%M} by `python -m analysis.report`"
           + (f" from {source}" if source else "") + ". Figures and CSV files sit next to this file.", ""]
    out += runs_section(data)
    out += results_section(data)
    out += variants_section(data, sweeps)
    out += frontier_section(data, left_out)
    out += compute_section(data, left_out)
    for name in GRIDS:
        out += heatmap_section(data, name, left_out, sweeps)
    out += best_of_n_section(data, left_out, sweeps)
    out += dynamics_section(left_out)
    out += diversity_section(data, left_out)
    out += failures_section(data, left_out)
    out += completions_section(data)
    return "\n".join(out)


def _run_rows(runs: pd.DataFrame, columns) -> list[list[str]]:
    return [[column(run) for column in columns] for _, run in runs.iterrows()]


def runs_section(data: ReportData) -> list[str]:
    """Which runs give numbers: used, superseded (and by which), unfinished, and labels shared by two configs."""
    protocols = dict(zip(data.results["run_id"], data.results["protocol"]))
    run_id, sweep = (lambda run: f"`{run['run_id']}`"), (lambda run: run.get("tags.sweep", ""))
    cell, started = (lambda run: run.get("tags.cell", "?")), (lambda run: when(run.get("start_time")))
    out = ["## Runs used", "",
           "Only FINISHED runs give numbers. When several finished runs share a cell (same `cell_id` tag: the "
           "config that decides results), the newest is used and the others are listed as superseded.", ""]
    out.append(markdown_table(["run id", "sweep", "cell", "status", "protocol used", "started"], _run_rows(
        data.used, [run_id, sweep, cell, lambda run: run["status"], lambda run: protocols.get(run["run_id"], "none"),
                    started])) if not data.used.empty else "_No finished runs._")
    out += ["", "### Superseded runs", ""]
    out.append(markdown_table(["run id", "sweep", "cell", "started", "superseded by"], _run_rows(
        data.superseded, [run_id, sweep, cell, started, lambda run: f"`{run['superseded_by']}`"]))
        if not data.superseded.empty else "_None._")
    out += ["", "### Unfinished runs (no numbers taken from them)", ""]
    out.append(markdown_table(["run id", "sweep", "cell", "status", "started"], _run_rows(
        data.unfinished, [run_id, sweep, cell, lambda run: run["status"], started]))
        if not data.unfinished.empty else "_None._")
    shared = same_label_configs(data.results)
    if not shared.empty:
        starts = dict(zip(data.used["run_id"], data.used["start_time"]))
        out += ["", "### Same label, different configuration", "",
                "**These rows share a label but are different experiments** (their `cell_id` differs: a knob or "
                "the warm-start weights changed between them), so the tables below hold each of them. To compare "
                "like with like, report only the newer runs (`--since`, `make report SINCE=2026-11-21T12:00`) "
                "or keep each study in its own experiment (`tracking.experiment=...`).", ""]
        out.append(markdown_table(["variant", "cell", "run id", "cell_id", "started"],
                                  [[row["variant"], row["cell"], f"`{row['run_id']}`", f"`{row['cell_id']}`",
                                    when(starts.get(row["run_id"]))] for _, row in shared.iterrows()]))
    return out


def protocol_note(results: pd.DataFrame) -> str:
    """Which evaluation protocol each row's numbers come from, and a warning when the report mixes them."""
    counts = results["protocol"].value_counts()
    parts = [f"{counts[p]} run(s) from `{p}/final/*`" for p in protocol_order(counts.index)]
    note = ("Values are read from `canonical/final/*` when a run has them, else from `quick/final/*`, else from "
            "the final evaluation of the protocol the run used (`smoke/final/*` for the quick check); "
            "the `protocol` column names the source of every row. Here: " + (", ".join(parts) or "no runs") + ".")
    if counts.drop("none", errors="ignore").size > 1:
        note += ("\n\n**Protocols are mixed in this report.** quick and canonical differ in samples per prompt, "
                 "repeats and seeds, so their values are not comparable; quick values are marked in the figures "
                 "(hollow markers, hatched bars, '(quick)' in heatmap cells).")
    if "none" in counts:
        note += "\n\nRows with protocol `none` finished without a final evaluation; their metrics are blank."
    return note


def results_section(data: ReportData) -> list[str]:
    """The summary table (paper Tables 2/3), then each cell over its training seeds against fresh-only."""
    results = data.results
    out = ["", "## Results (paper Tables 2/3)", "", protocol_note(results), "",
           f"Each value is `mean ± 95 % t half-width` over evaluation repeats (just the mean when the protocol "
           f"has one repeat). The high-k column is {data.label}. Full numbers: [results_table.csv](results_table.csv); "
           "a one-column version for a paper: [results_table.tex](results_table.tex) (LaTeX, `booktabs`).", ""]
    out.append(markdown_table(*results_cells(results)) if not results.empty else "_No finished runs._")
    if not data.cells.empty:
        out += ["", "## Across training seeds", "", seeds_note(data.cells), "", seeds_markdown(data.cells, data.label)]
    return out


def seeds_note(cells: pd.DataFrame) -> str:
    baseline = cells[cells["is_baseline"]]
    reference = (f"the fresh-only cell `{baseline['cell'].iloc[0]}` (seeds {baseline['seeds'].iloc[0]})"
                 if not baseline.empty else "no fresh-only cell in this report, so no differences")
    return ("One row per cell over its training seeds (runs grouped by the `cell_key` tag; the evaluation repeats "
            "are averaged within each seed first). Values are `mean ± 95 % t half-width over seeds` (just the mean "
            f"with one seed). Δ is the cell minus {reference} at the same seeds, `± half-width` of the seed-wise "
            f"differences; the verdict is a {seeds.TEST_NAME} (two-sided): `better`/`worse` where the difference's "
            "interval excludes 0, `within noise` where it does not, `one seed` where only one seed pairs up. "
            "Replay ESS is the mean over steps of the reused responses' normalised ESS. "
            "Full numbers: [seeds.csv](seeds.csv).")


def seeds_markdown(cells: pd.DataFrame, label: str) -> str:
    """The seed table: each cell's mean over seeds, its difference to fresh-only and the verdict."""
    def over_seeds(row, metric):
        return format_value(row[metric], row[metric + "_hw"] if row["n_seeds"] > 1 else np.nan)

    def compared(row, metric):
        if row["is_baseline"] or pd.isna(row.get(metric + "_diff", np.nan)):
            return ["(reference)" if row["is_baseline"] else "-", row.get(metric + "_verdict", "-")
                    if not row["is_baseline"] and isinstance(row.get(metric + "_verdict"), str) else "-"]
        diff = f"{row[metric + '_diff']:+.3f}" + (f" ± {row[metric + '_diff_hw']:.3f}"
                                                  if not pd.isna(row[metric + "_diff_hw"]) else "")
        return [diff, row[metric + "_verdict"]]

    headers = ["variant", "(ρ, L, c)", "cell", "seeds", "rollouts (fresh evals)", "reward", "Δ reward", "verdict",
               "pass@1", "Δ pass@1", "verdict", label, f"Δ {label}", "verdict", "replay ESS"]
    rows = [[row["variant"], row["coordinates"], row["cell"], f"{row['n_seeds']} ({row['seeds']})",
             format_count(row["fresh_evaluations"]),
             over_seeds(row, "reward"), *compared(row, "reward"), over_seeds(row, "pass@1"), *compared(row, "pass@1"),
             over_seeds(row, "pass@k_max"), *compared(row, "pass@k_max"),
             format_ratio(row.get("replay_ess", np.nan))] for _, row in cells.iterrows()]
    return markdown_table(headers, rows)


def variants_section(data: ReportData, sweeps: list[str] | None) -> list[str]:
    """SPEC 9: each variant's cost next to its result, with the fresh-only and plain reference cells."""
    variants = data.variants
    # Also before any variant finished: the variants study's reference cells are worth a look already.
    if variants.empty and VARIANT_STUDY not in (sweeps or []):
        return []
    out = ["", "## Variants (SPEC 9)", "",
           "Each variant against its references (the fresh-only baseline and the plain cells of the "
           f"`{VARIANT_STUDY}` study). Rollouts generated = fresh verifier evaluations (every generated rollout "
           "is one); gradient steps = optimizer steps; effective ratio = share of trained groups with non-zero "
           "reward variance over the run. '-': the run did not log it. Variants never enter the heatmaps and "
           "are never the fresh-only baseline. Full numbers: [variants.csv](variants.csv).", ""]
    parts = [variants_markdown(variants, data.label)] if not variants.empty else []
    if not (variants["setting"] == "Variant").any():
        parts.append("_No finished variant runs yet._")
    return out + ["\n\n".join(parts)]


def variants_markdown(variants: pd.DataFrame, label: str) -> str:
    """The Variants table: cost (rollouts, gradient steps, effective ratio) next to the result of each run."""
    mixed_k = variants["k_max"].dropna().nunique() > 1
    headers = ["variant", "cell", "rollouts generated", "gradient steps", "effective ratio", "reward", "pass@1",
               label if not mixed_k else "pass@k (largest k)", "protocol", "run"]
    rows = [[row["variant"], row["cell"], format_count(row["fresh_evaluations"]), format_integer(row["gradient_steps"]),
             format_ratio(row["effective_ratio"]), format_value(row["reward"], row["reward_hw"]),
             format_value(row["pass@1"], row["pass@1_hw"]), top_k(row, mixed_k), row["protocol"],
             f"`{row['run_id'][:8]}`"] for _, row in variants.iterrows()]
    return markdown_table(headers, rows)


def frontier_section(data: ReportData, left_out: dict[str, str]) -> list[str]:
    has_variants = (data.variants["setting"] == "Variant").any() if not data.variants.empty else False
    out = ["", "## Budget frontier (Figure 3)", "",
           f"{data.label} against fresh verifier evaluations; colour is ρ, marker is c, the star and dashed line are "
           "the fresh-only baseline, error bars are 95 % half-widths over repeats (none where a cell has one repeat)"
           + ("; each variant has its own labelled marker (left panel legend)" if has_variants else "") + ".", "",
           *figure_lines("frontier", "budget frontier", f"Figure 3. Held-out {data.label} against fresh verifier "
                         "evaluations; star: fresh-only; error bars: 95 % half-widths.", left_out.get("frontier"))]
    if "frontier_sweep" in left_out:
        out += ["", f"_Panel left out: {left_out['frontier_sweep']}._"]
    return out + [""]


def compute_section(data: ReportData, left_out: dict[str, str]) -> list[str]:
    """The compute frontier: the figure, what its absent panels lack, and each cell's costs."""
    cells, label = data.per_cell, data.label
    out = ["## Compute frontier", "",
           f"{label} against three costs (seed 001 counts compute, not only samples): fresh verifier evaluations, "
           "trained tokens (`budget/trained_tokens`: response tokens that entered the loss, cumulative) and training "
           "wall time (the sum of the per-step `time/step`: training steps only, no evaluation; runs without it: end "
           "minus start). One point per cell, its mean over training seeds; error bars are 95 % half-widths over "
           "seeds, or over evaluation repeats for a cell with one seed. Generated tokens "
           "(`budget/generated_tokens`) are listed below.", "",
           *figure_lines("compute_frontier", "compute frontier", f"{label} against fresh verifier evaluations, "
                         "trained tokens and training wall time, one point per cell.",
                         left_out.get("compute_frontier")),
           ""]
    missing = compute.missing_axes(cells) + (
        [] if "generated_tokens" in cells and cells["generated_tokens"].notna().any()
        else ["no budget/generated_tokens logged by these runs"])
    if missing:
        out += ["Not drawn or listed: " + "; ".join(missing) + ".", ""]
    if not cells.empty:
        out += [markdown_table(
            ["variant", "cell", "fresh evals", "generated tokens", "trained tokens", "training wall time", label],
            [[row["variant"], row["cell"], format_count(row["fresh_evaluations"]),
              format_count(row.get("generated_tokens", np.nan)), format_count(row.get("trained_tokens", np.nan)),
              format_seconds(row.get("wall_time_s", np.nan)), format_value(row["pass@k_max"], row["pass@k_max_hw"])]
             for _, row in cells.iterrows()]), ""]
    return out


def heatmap_section(data: ReportData, name: str, left_out: dict[str, str], sweeps: list[str] | None) -> list[str]:
    """One design grid (Figure 4, or Figures 5 and 9): the heatmaps, or the cells they still need."""
    spec, grid, figure = GRIDS[name], data.grids[name], {"age": "Figure 4", "ratio": "Figures 5 and 9"}[name]
    no_run, no_eval = missing_cells(grid)
    pending = dict(zip(grid["cell"], grid["unfinished"]))
    out = [f"## Heatmap: {spec['title']} ({figure})", ""]
    if f"heatmap_{name}" not in left_out:
        out += [f"Panels: {data.label}, evaluation reward, correction rate, pass@1; cells show mean ± half-width, "
                "the colour map is centred on the fresh-only value named in each panel title"
                + ("" if data.baseline else " (no fresh-only run in this report, so the map is not centred)")
                + ". Only the rows and columns with a run are drawn; missing cells among them are grey and hatched. "
                "A cell with several training seeds shows its mean ± half-width over seeds; where its difference to "
                "fresh-only is within noise (paired t-test over seeds, 95 %) it is outlined dotted and marked "
                "'≈ fresh-only (noise)'.", ""]
    out += [*figure_lines(f"heatmap_{name}", spec["title"], f"{figure}. {spec['title']}: held-out metrics per grid "
                          "cell, colour centred on the fresh-only value.", left_out.get(f"heatmap_{name}")), "",
            "Missing grid cells (no finished run): " + (", ".join(
                f"`{c}`" + (f" ({status} run)" if (status := pending.get(c)) else "") for c in no_run) or "none") + "."]
    if no_eval:
        out.append("Cells with a finished run but no final evaluation: " + ", ".join(f"`{c}`" for c in no_eval) + ".")
    if no_run and sweeps:
        out.append("(Studies share cells, SPEC 8. A shared cell skipped by the sweeper is found through the "
                   "`sweeps` tag; one run outside any sweep can be added with another `--sweep` option.)")
    return out + [""]


def best_of_n_section(data: ReportData, left_out: dict[str, str], sweeps: list[str] | None) -> list[str]:
    out = ["## Best-of-N probe (Table 4, Figure 6)", "",
           "Unbiased pass@k from `probe/final/*` (64 samples per prompt per repeat); a different estimator and "
           "seed namespace from the canonical table, so the two are complementary, not one scale. "
           "Full numbers: [best_of_n.csv](best_of_n.csv).", ""]
    if data.probe.empty:
        hint = probe_hint(sweeps).split("\n")
        return out + [f"_{hint[0]}_", "", "```", hint[1], "```", "", f"_{hint[2]}_", ""]
    out.append(markdown_table(["variant", "(ρ, L, c)", "cell", *[f"K={k}" for k in data.probe_ks], "run"],
                              [[row["variant"], row["coordinates"], row["cell"],
                                *[format_value(row[f"pass@{k}"], row[f"pass@{k}_hw"]) for k in data.probe_ks],
                                f"`{row['run_id'][:8]}`"] for _, row in data.probe.iterrows()]))
    return out + ["", *figure_lines("best_of_n", "best-of-N probe", "Figure 6. Unbiased pass@k against the number of "
                                    "samples k per prompt (log scale); fresh-only dashed.", left_out.get("best_of_n")),
                  ""]


def dynamics_section(left_out: dict[str, str]) -> list[str]:
    out = ["## Training dynamics (Figure 7)", "",
           "Per-step training reward, clip fraction and normalised ESS of the reused responses (absent for "
           "fresh-only runs and for steps without replay), and KL to the reference per token; colour is c, "
           "line style is L, fresh-only in black, variants dash-dotted in their own colour. One line per cell: with "
           "several training seeds it is the mean over seeds with the min-max range across seeds shaded.", "",
           *figure_lines("dynamics", "training dynamics", "Figure 7. Training signals against the optimizer step, "
                         "one line per cell.", left_out.get("dynamics"))]
    if "dynamics_panels" in left_out:
        out += ["", f"_Panels left out: {left_out['dynamics_panels']}._"]
    return out + [""]


def diversity_section(data: ReportData, left_out: dict[str, str]) -> list[str]:
    results = data.results
    out = ["## Diversity (Figure 8)", "",
           "Answer-span unique rate of the final evaluation (same protocol as the results table), error bars "
           "are half-widths.", ""]
    diversity = results[results["unique_rate"].notna()] if not results.empty else results
    if not diversity.empty:
        out += [markdown_table(["cell", "(ρ, L, c)", "protocol", "unique rate"],
                               [[row["cell"], row["coordinates"], row["protocol"],
                                 format_value(row["unique_rate"], row["unique_rate_hw"])]
                                for _, row in diversity.iterrows()]), ""]
    return out + [*figure_lines("diversity", "answer-span diversity", "Figure 8. Answer-span unique rate of the "
                                "final evaluation by cell; hatched: quick protocol.", left_out.get("diversity")), ""]


def _count(value: float) -> str:
    """A count per evaluation repeat: whole numbers as integers, means over repeats with one decimal."""
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def failures_section(data: ReportData, left_out: dict[str, str]) -> list[str]:
    failures = data.failures
    out = ["## Failure taxonomy (seed 004 Figures 3-4, appendix B.4)", "",
           "Each failed rollout (score < 1.0) of an evaluation in one dominant category, in its task's order of "
           "checks (Countdown, `src/task/countdown_failures.py`: global instability first, then format, number use, "
           "arithmetic, target; math, `src/task/math/failures.py`: no boxed answer, unparseable, wrong, truncated, "
           "repetitive). "
           "Counts are failed rollouts per evaluation repeat; the percentage is the category's share of the "
           "failed rollouts. The warm start is the start evaluation of the runs. Full numbers: "
           "[failures.csv](failures.csv).", ""]
    if failures.empty:
        return out + ["_No evaluation of these runs logged a failure taxonomy (`<protocol>/<stage>/failures/*`)._", ""]
    categories = [c for c in FAILURE_CATEGORIES if c in failures.columns]  # the ones these runs' tasks logged
    out.append(markdown_table(
        ["method", "cell", "stage", "protocol", "failed / rollouts", *[FAILURE_LABELS[c] for c in categories]],
        [[row["method"], row["cell"], row["stage"], row["protocol"],
          f"{_count(row['failed'])} / {_count(row['rollouts'])}",
          *[f"{_count(row[c])} ({row[f'share_{c}']:.0%})" if row["failed"] > 0 else "0" for c in categories]]
         for _, row in failures.iterrows()]))
    return out + ["", *figure_lines("failure_shares", "failure categories", "Failed rollouts by dominant category, as "
                                    "shares of each method's failures (seed 004 Figure 3).",
                                    left_out.get("failure_shares")), "",
                  *figure_lines("failure_totals", "failed rollouts", "Failed rollouts per evaluation repeat by method "
                                "(seed 004 Figure 4).", left_out.get("failure_totals")), ""]


def _quote(text, limit: int, tail: bool = False) -> str:
    """Text for an indented code block: cut to `limit` characters (the end of it with `tail`), every line indented."""
    text = str(text) if text is not None and not (isinstance(text, float) and pd.isna(text)) else ""
    if len(text) > limit:
        text = "…" + text[-limit:] if tail else text[:limit] + "…"
    return "\n".join("    " + line for line in text.splitlines() or [""])


def _problem_lines(row) -> list[str]:
    """What the completion answers: the task's own words for the instance (the `problem` column), else (a table
    logged without that column) the end of the prompt, where the task follows the shared instructions."""
    problem = row.get("problem")
    if isinstance(problem, str) and problem:
        return ["    problem:", _quote(problem, PROMPT_CHARS)]
    return ["    prompt (its end):", _quote(row["prompt"], PROMPT_CHARS, tail=True)]


def completions_section(data: ReportData) -> list[str]:
    """A few completions per cell (best, median, worst reward at the last logged step), quoted verbatim."""
    out = ["## Sample completions", ""]
    quotes = data.completions
    if quotes is None or quotes.empty:
        return out + ["_Left out: no run of this report logged a completions table (`completions/train.json` or "
                      "`completions/eval.json`, written with `mlflow.log_table`)._", ""]
    out += ["What the policy wrote: for each run, the best, the median and the worst reward at the last logged step "
            "of its completions table (the run's artifacts hold every row; open them in the MLflow UI).", ""]
    cells = dict(zip(data.results["run_id"], zip(data.results["cell"], data.results["variant"])))
    for run_id, rows in quotes.groupby("run_id", sort=False):
        cell, variant = cells.get(run_id, ("?", "?"))
        out += [f"### {cell} ({variant}), `{rows['table'].iloc[0]}` table, step {rows['step'].iloc[0]}", ""]
        for _, row in rows.iterrows():
            facts = [f"reward {row['reward']:.3f}"] + [f"{name} {row[name]}" for name in ("source", "age", "category")
                                                       if not pd.isna(row[name]) and str(row[name]) != ""]
            out += [f"**{row['pick']}** ({', '.join(facts)}):", "", *_problem_lines(row), "    response:",
                    _quote(row["response"], QUOTE_CHARS), ""]
            if not pd.isna(row["reason"]) and str(row["reason"]):
                out += [f"verifier: {row['reason']}", ""]
    return out
