"""analysis.report on synthetic MLflow stores: run selection, exact numbers, missing cells, figures, CLI errors.

Two stores: `store` holds grid runs with only the grid tags (cell, rho, L, c; no variant label);
`mixed` adds SPEC 9 variants (FIFO, POPO, DAPO, a POPO run without the `variant` tag) next to
plain cells that carry every tag, to check that variants get their own table and never a grid cell.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

import matplotlib.pyplot as plt
import mlflow
import pandas as pd
import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient
from PIL import Image

from analysis import figures, report, tables
from analysis.runs import format_cell, is_plain, load_runs, select_cells

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIGURES = ["frontier.png", "dynamics.png", "diversity.png"]  # drawn by every report with an evaluated run
HEATMAPS = ["heatmap_age.png", "heatmap_ratio.png"]  # drawn where a grid has two or more cells
EXPERIMENT = "report-test"

BASELINE_CANONICAL = {"pass_at_1": 0.576, "pass_at_1_hw": 0.051, "pass_at_2": 0.62, "pass_at_2_hw": 0.02,
                      "pass_at_4": 0.68, "pass_at_4_hw": 0.02, "pass_at_8": 0.72, "pass_at_8_hw": 0.015,
                      "pass_at_16": 0.756, "pass_at_16_hw": 0.011, "mean_reward": 0.622, "mean_reward_hw": 0.005,
                      "correction_rate": 0.594, "correction_rate_hw": 0.005, "unique_rate": 0.429,
                      "unique_rate_hw": 0.012}
OLD_C1_CANONICAL = {"pass_at_1": 0.5, "pass_at_16": 0.7, "mean_reward": 0.5, "correction_rate": 0.5}
NEW_C1_QUICK = {"pass_at_1": 0.32, "pass_at_4": 0.38, "pass_at_8": 0.42, "mean_reward": 0.39,
                "correction_rate": 0.323, "unique_rate": 0.217}  # one repeat: no half-widths
AGGRESSIVE_CANONICAL = {"pass_at_1": 0.6, "pass_at_1_hw": 0.058, "pass_at_16": 0.832, "pass_at_16_hw": 0.014,
                        "mean_reward": 0.629, "mean_reward_hw": 0.006, "correction_rate": 0.614,
                        "correction_rate_hw": 0.006, "unique_rate": 0.3, "unique_rate_hw": 0.01}
PROBE = {"pass_at_1": 0.609, "pass_at_4": 0.76, "pass_at_8": 0.798, "pass_at_16": 0.819, "pass_at_32": 0.831,
         "pass_at_64": 0.844, "pass_at_64_hw": 0.01}


def _log_run(client: MlflowClient, experiment_id: str, *, started: int, sweep: str, rho: float, L: int, c: float,
             status: str = "FINISHED", final: dict[str, dict[str, float]] | None = None,
             fresh: int | None = None, steps: int = 4, cell: str | None = None, tags: dict[str, str] | None = None,
             per_step: dict[str, list[float]] | None = None) -> str:
    """One run as src.run logs it: tags, a few params, per-step metrics, final evaluation metrics.

    `tags` adds or overrides tags (the newer runner's buffer/loss/sampling/variant tags); `per_step`
    adds or replaces per-step metric series (one value per step).
    """
    cell = cell or ("rho0" if rho == 0 else f"rho{rho:g}-L{L}-c{c:g}")
    tags = {"sweep": sweep, "cell": cell, "rho": f"{rho:g}", "L": str(L if rho else 0), "c": f"{c:g}",
            "policy": "tiny", "evaluation": "canonical", "mlflow.runName": cell, **(tags or {})}
    if fresh is not None:
        tags["fresh_evaluations"] = str(fresh)
    run = client.create_run(experiment_id, start_time=started, tags=tags)
    stamp = started + 1000
    series = {"train/reward": [0.3 + 0.01 * step for step in range(steps)],
              "train/kl_per_token": [0.001 * step for step in range(steps)],
              "budget/fresh_evaluations": [64.0 * (step + 1) for step in range(steps)], **(per_step or {})}
    metrics = []
    for step in range(steps):
        metrics += [Metric(key, values[step], stamp, step) for key, values in series.items()]
        if rho > 0 and step > 0:  # importance weights exist only on steps that reused groups
            metrics += [Metric("weights/clip_fraction", 0.4, stamp, step), Metric("weights/ess", 0.9, stamp, step)]
    for protocol, values in (final or {}).items():
        metrics += [Metric(f"{protocol}/final/{key}", value, stamp, steps) for key, value in values.items()]
    params = [Param("buffer.ratio", str(rho)), Param("buffer.max_age", str(L)), Param("clip.ceiling", str(c))]
    client.log_batch(run.info.run_id, metrics=metrics, params=params)
    client.set_terminated(run.info.run_id, status=status, end_time=started + 5000)
    return run.info.run_id


def _new_store(tmp_path_factory, name: str):
    """A fresh SQLite tracking store with the report's experiment: (folder, uri, client, experiment id)."""
    folder = tmp_path_factory.mktemp(name)
    uri = f"sqlite:///{folder}/mlruns.db"
    client = MlflowClient(uri)
    experiment_id = client.create_experiment(EXPERIMENT, artifact_location=(folder / "artifacts").as_uri())
    return folder, uri, client, experiment_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A SQLite store: baseline, two runs of one cell, a FAILED and a KILLED run, a probed rho = 2 run."""
    folder, uri, client, experiment_id = _new_store(tmp_path_factory, "store")
    previous = mlflow.get_tracking_uri()
    client.create_experiment("empty", artifact_location=(folder / "empty").as_uri())
    t0 = int(time.time() * 1000)
    ids = {
        "baseline": _log_run(client, experiment_id, started=t0, sweep="baseline", rho=0, L=0, c=10, fresh=102400,
                             final={"canonical": BASELINE_CANONICAL, "quick": {"pass_at_1": 0.1, "pass_at_8": 0.2},
                                    "probe": {k: v if k.endswith("_hw") else v - 0.02 for k, v in PROBE.items()}}),
        "old_c1": _log_run(client, experiment_id, started=t0 + 10_000, sweep="age", rho=1, L=1, c=1, fresh=51712,
                           final={"canonical": OLD_C1_CANONICAL}),
        "new_c1": _log_run(client, experiment_id, started=t0 + 20_000, sweep="age", rho=1, L=1, c=1,
                           final={"quick": NEW_C1_QUICK}),  # no fresh_evaluations tag: falls back to the metric
        "failed": _log_run(client, experiment_id, started=t0 + 30_000, sweep="age", rho=1, L=2, c=10,
                           status="FAILED", final={"canonical": BASELINE_CANONICAL}),
        "aggressive": _log_run(client, experiment_id, started=t0 + 40_000, sweep="ratio", rho=2, L=2, c=1,
                               fresh=35100, final={"canonical": AGGRESSIVE_CANONICAL, "probe": PROBE}),
        "killed": _log_run(client, experiment_id, started=t0 + 50_000, sweep="stress", rho=1, L=1, c=1000,
                           status="KILLED"),
    }
    runs = load_runs(uri, EXPERIMENT)
    out = folder / "report"
    path = report.write_report(runs, out, client, sweeps=None)
    yield {"uri": uri, "client": client, "ids": ids, "runs": runs, "out": out, "report": path,
           "text": path.read_text(), "folder": folder}
    mlflow.set_tracking_uri(previous)


def test_select_cells_newest_finished_per_cell(store):
    ids = store["ids"]
    used, superseded, unfinished = select_cells(store["runs"])
    assert set(used["run_id"]) == {ids["baseline"], ids["new_c1"], ids["aggressive"]}
    assert superseded["run_id"].tolist() == [ids["old_c1"]]
    assert superseded["superseded_by"].tolist() == [ids["new_c1"]]
    assert unfinished["run_id"].tolist() == [ids["killed"], ids["failed"]]  # newest first
    assert unfinished["status"].tolist() == ["KILLED", "FAILED"]


def test_results_table_has_the_logged_numbers(store):
    ids = store["ids"]
    used, _, _ = select_cells(store["runs"])
    table = tables.results_table(used)
    # Baseline first, then by rho, L, c.
    assert table["run_id"].tolist() == [ids["baseline"], ids["new_c1"], ids["aggressive"]]
    base, quick, aggressive = (table.iloc[i] for i in range(3))
    # canonical is preferred over quick when a run has both; the quick-only run says so.
    assert table["protocol"].tolist() == ["canonical", "quick", "canonical"]
    assert base["setting"] == "Fresh-only" and base["coordinates"] == "(0, -, -)"
    assert pd.isna(base["L"]) and pd.isna(base["c"])  # the clip tag of a fresh-only run is ignored
    assert aggressive["setting"] == "Replay" and aggressive["coordinates"] == "(2, 2, 1)"
    assert (aggressive["rho"], aggressive["L"], aggressive["c"]) == (2.0, 2.0, 1.0)
    for name, key in [("pass@1", "pass_at_1"), ("pass@16", "pass_at_16"), ("reward", "mean_reward"),
                      ("correction_rate", "correction_rate"), ("unique_rate", "unique_rate")]:
        assert base[name] == BASELINE_CANONICAL[key]
        assert base[name + "_hw"] == BASELINE_CANONICAL[key + "_hw"]
        assert aggressive[name] == AGGRESSIVE_CANONICAL[key]
    assert base["pass@k_max"] == 0.756 and base["k_max"] == 16 and base["pass@k_max_hw"] == 0.011
    assert quick["pass@k_max"] == 0.42 and quick["k_max"] == 8 and pd.isna(quick["pass@k_max_hw"])
    assert quick["pass@1"] == 0.32 and pd.isna(quick["pass@1_hw"]) and pd.isna(quick["pass@16"])
    assert base["fresh_evaluations"] == 102400 and aggressive["fresh_evaluations"] == 35100
    assert quick["fresh_evaluations"] == 64 * 4  # last logged budget/fresh_evaluations
    # Runs without the variant tags and metrics: plain grid runs labelled as before, no budget extras.
    assert table["plain"].tolist() == [True, True, True]
    assert table["variant"].tolist() == table["setting"].tolist() == ["Fresh-only", "Replay", "Replay"]
    assert table["gradient_steps"].isna().all() and table["effective_ratio"].isna().all()

    csv = pd.read_csv(store["out"] / "results_table.csv")
    assert csv["run_id"].tolist() == table["run_id"].tolist()
    assert csv["pass@16"].iloc[0] == 0.756 and csv["protocol"].tolist() == table["protocol"].tolist()


def test_value_formatting():
    assert tables.format_value(0.576, 0.051) == "0.576 ± 0.051"
    assert tables.format_value(0.32) == "0.320"
    assert tables.format_value(float("nan"), 0.1) == "-"
    assert format_cell(0, float("nan"), float("nan")) == "(0, -, -)"
    assert format_cell(1.5, 2, 10) == "(1.5, 2, 10)"
    assert tables.format_count(51712) == "51.7K" and tables.format_count(256) == "256"


def test_report_markdown(store):
    text, ids = store["text"], store["ids"]
    for run_id in ids.values():  # used, superseded and unfinished runs are all named in full
        assert f"`{run_id}`" in text
    # Table rows: mean ± hw for canonical, bare mean for the one-repeat quick run, the protocol per row.
    # Runs that did not log budget/gradient_steps and the effective ratio show '-' there.
    assert "| Fresh-only | (0, -, -) | rho0 | canonical | 102.4K | - | - | 0.576 ± 0.051 | 0.756 ± 0.011 (k=16) | " \
           "0.622 ± 0.005 | 0.594 ± 0.005 |" in text
    assert "| Replay | (1, 1, 1) | rho1-L1-c1 | quick | 256 | - | - | 0.320 | 0.420 (k=8) | 0.390 | 0.323 |" in text
    assert "Protocols are mixed in this report" in text
    # Best-of-N table from the probe metrics.
    assert "| Replay | (2, 2, 1) | rho2-L2-c1 | 0.609 | 0.760 | 0.798 | 0.819 | 0.831 | 0.844 ± 0.010 |" in text
    for name in [*FIGURES, "best_of_n.png", "results_table.csv"]:
        assert f"({name})" in text  # embedded / linked with relative paths
    # One cell in each grid: no heatmap, and a line naming the cells it needs instead of an empty panel.
    for name in HEATMAPS:
        assert f"({name})" not in text and not (store["out"] / name).exists()
    assert "_Figure left out: 1 of its 9 cells ran, and a heatmap needs at least 2; the cells it lacks are listed " \
           "below (`make sweep-age` runs them all)._" in text
    # No variant runs and no variants sweep: no Variants section, an empty variants.csv all the same.
    assert "## Variants" not in text
    assert pd.read_csv(store["out"] / "variants.csv").empty


def test_missing_heatmap_cells(store):
    used, _, unfinished = select_cells(store["runs"])
    results = tables.results_table(used)
    age = tables.heatmap_grid(results, "age", unfinished)
    age_missing, age_no_eval = tables.missing_cells(age)
    assert len(age) == 9 and age.loc[age["cell"] == "rho1-L2-c10", "unfinished"].item() == "FAILED"
    assert "rho1-L1-c1" not in age_missing and len(age_missing) == 8
    assert "rho1-L2-c10" in age_missing  # its only run FAILED: missing, never filled
    ratio = tables.heatmap_grid(results, "ratio")
    ratio_missing, _ = tables.missing_cells(ratio)
    assert len(ratio) == 12 and len(ratio_missing) == 11 and "rho2-L2-c1" not in ratio_missing
    assert ratio.loc[ratio["cell"] == "rho2-L2-c1", "pass@k_max"].item() == 0.832
    assert age_no_eval == []
    assert "Missing grid cells (no finished run): `rho1-L1-c3`" in store["text"]
    assert "`rho1-L2-c10` (FAILED run)" in store["text"].split("## Heatmap: L × c")[1]


def _assert_png(path: Path) -> None:
    assert path.exists(), path
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
    assert plt.imread(path).ndim == 3


def test_every_figure_is_a_png(store):
    for name in [*FIGURES, "best_of_n.png"]:
        _assert_png(store["out"] / name)


def test_cli_report_without_finished_runs(store, tmp_path, capsys):
    """A sweep whose only run was killed gets every table and no figure; report.md says what is missing. The
    printed path stays whole on one line, longer than a log's 80 columns."""
    tmp_path = tmp_path / ("a-report-folder-" * 5)
    tmp_path.mkdir()
    stale = tmp_path / "frontier.png"  # a figure an earlier report wrote into the same folder
    stale.write_bytes(PNG_SIGNATURE)
    code = report.main(["--experiment", EXPERIMENT, "--sweep", "stress", "--out", str(tmp_path),
                        f"tracking.uri={store['uri']}"])
    assert code == 0
    assert str(tmp_path / "report.md") in capsys.readouterr().out
    assert not list(tmp_path.glob("*.png")) and (tmp_path / "results_table.csv").exists()
    text = (tmp_path / "report.md").read_text()
    assert "_Figure left out: no finished run with a final evaluation yet._" in text
    assert "_No finished runs._" in text and f"`{store['ids']['killed']}`" in text
    assert store["ids"]["baseline"] not in text  # the sweep filter
    assert "no probe results yet" in text and "found through the `sweeps` tag" in text


@pytest.mark.parametrize("experiment, message", [
    ("empty", "no runs found in experiment 'empty'"),
    ("nope", "experiment 'nope' not found"),
])
def test_cli_errors_exit_nonzero(store, capsys, experiment, message):
    code = report.main(["--experiment", experiment, f"tracking.uri={store['uri']}"])
    err = capsys.readouterr().err
    assert code != 0
    assert message in err and store["uri"] in err  # names what was searched
    assert "Traceback" not in err


# --------------------------------------------------------------------------- variants (SPEC 9)

# (fresh tag or None, gradient_steps per step, cumulative effective fraction per step): the last values count.
MIXED_BASELINE = {"pass_at_1": 0.4, "pass_at_1_hw": 0.02, "pass_at_16": 0.7, "pass_at_16_hw": 0.01,
                  "mean_reward": 0.5, "mean_reward_hw": 0.01, "correction_rate": 0.45, "correction_rate_hw": 0.01}
MIXED_REPLAY = {"pass_at_1": 0.42, "pass_at_1_hw": 0.02, "pass_at_16": 0.72, "pass_at_16_hw": 0.01,
                "mean_reward": 0.52, "mean_reward_hw": 0.01, "correction_rate": 0.47, "correction_rate_hw": 0.01}
MIXED_OLD = {"pass_at_1": 0.3, "pass_at_16": 0.6, "mean_reward": 0.35, "correction_rate": 0.3}
# Variants score far above the grid: a variant leaking into a heatmap cell or the baseline would show.
FIFO_FINAL = {"pass_at_1": 0.61, "pass_at_1_hw": 0.03, "pass_at_16": 0.91, "pass_at_16_hw": 0.02,
              "mean_reward": 0.66, "mean_reward_hw": 0.02, "correction_rate": 0.6, "correction_rate_hw": 0.02}
POPO_QUICK = {"pass_at_1": 0.55, "pass_at_4": 0.7, "pass_at_8": 0.8, "mean_reward": 0.58, "correction_rate": 0.5}
DAPO_FINAL = {"pass_at_1": 0.63, "pass_at_1_hw": 0.03, "pass_at_16": 0.95, "pass_at_16_hw": 0.01,
              "mean_reward": 0.7, "mean_reward_hw": 0.02, "correction_rate": 0.62, "correction_rate_hw": 0.02}
NEW_TAGS = {"buffer": "none", "loss": "rloo", "sampling": "standard", "behaviour": "current", "curriculum": "none"}


def _budget(gradient_steps: list[float], effective: list[float]) -> dict[str, list[float]]:
    return {"budget/gradient_steps": gradient_steps, "batch/effective_fraction_cumulative": effective}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Plain cells with and without the new tags, variants whose rho/L/c tags sit on grid positions, the report."""
    folder, uri, client, experiment_id = _new_store(tmp_path_factory, "mixed")
    previous = mlflow.get_tracking_uri()
    t0 = int(time.time() * 1000)
    log = dict(client=client, experiment_id=experiment_id)
    ids = {
        # The variants study reuses the baseline and age cells: found through the `sweeps` tag.
        "baseline": _log_run(**log, started=t0, sweep="baseline", rho=0, L=0, c=10, fresh=1024,
                             tags={**NEW_TAGS, "variant": "Fresh-only", "sweeps": ",baseline,variants,"},
                             per_step=_budget([1, 2, 3, 4], [0.5, 0.5, 0.6, 0.625]),
                             final={"canonical": MIXED_BASELINE}),
        "replay": _log_run(**log, started=t0 + 10_000, sweep="age", rho=1, L=1, c=1, fresh=768,
                           tags={**NEW_TAGS, "buffer": "age1", "variant": "Replay-RLOO", "sweeps": ",age,variants,"},
                           per_step=_budget([1, 2, 3, 4], [0.4, 0.5, 0.5, 0.55]), final={"canonical": MIXED_REPLAY}),
        # Logged before the new tags and metrics: no buffer/loss/variant tags, no gradient steps.
        "old": _log_run(**log, started=t0 + 20_000, sweep="age", rho=1, L=2, c=3, fresh=640,
                        final={"canonical": MIXED_OLD}),
        # FIFO at rho = 1, L = 2, c = 1: both grids have that position, and no plain run fills it.
        "fifo": _log_run(**log, started=t0 + 30_000, sweep="variants", rho=1, L=2, c=1, fresh=512,
                         cell="fifo-rho1-N256-with_replacement-pb0.5-c1",
                         tags={**NEW_TAGS, "buffer": "fifo", "variant": "FIFO replay δ=0.5"},
                         per_step=_budget([2, 4, 6, 8], [0.6, 0.7, 0.7, 0.75]), final={"canonical": FIFO_FINAL}),
        # POPO without a fresh_evaluations tag: rollouts come from the last budget metric.
        "popo": _log_run(**log, started=t0 + 40_000, sweep="variants", rho=0, L=0, c=1, cell="popo-grpo",
                         tags={**NEW_TAGS, "buffer": "popo", "loss": "grpo", "variant": "POPO"},
                         per_step={**_budget([4, 8, 12, 16], [1.0, 1.0, 1.0, 1.0]),
                                   "budget/fresh_evaluations": [100.0, 180.0, 220.0, 256.0]},
                         final={"quick": POPO_QUICK}),
        # DAPO at rho = 0 scores far above the fresh-only run: it must not become the baseline.
        "dapo": _log_run(**log, started=t0 + 50_000, sweep="variants", rho=0, L=0, c=10, fresh=2560,
                         cell="rho0-dapo", tags={**NEW_TAGS, "sampling": "dynamic", "variant": "DAPO dynamic sampling"},
                         per_step=_budget([1, 2, 3, 4], [1.0, 1.0, 1.0, 1.0]), final={"canonical": DAPO_FINAL}),
        # A variant run without a `variant` label: named by its cell, not as 'Replay'.
        "popo_untagged": _log_run(**log, started=t0 + 60_000, sweep="variants", rho=1, L=1, c=1, fresh=300,
                                  cell="popo-stale2-c1", tags={"buffer": "popo"}, final={"canonical": MIXED_OLD}),
        # A failed variant at a grid cell's coordinates (its label carries the variant): no reason for that grid
        # cell to be missing.
        "stale_failed": _log_run(**log, started=t0 + 70_000, sweep="variants", rho=1, L=3, c=10, status="FAILED",
                                 cell="rho1-L3-c10-stale4",
                                 tags={**NEW_TAGS, "buffer": "age3", "behaviour": "stale",
                                       "variant": "stale behaviour n=4"}),
    }
    runs = load_runs(uri, EXPERIMENT)
    out = folder / "report"
    path = report.write_report(runs, out, client, sweeps=None)
    used, _, unfinished = select_cells(runs)
    yield {"uri": uri, "client": client, "ids": ids, "runs": runs, "out": out, "text": path.read_text(),
           "used": used, "unfinished": unfinished, "results": tables.results_table(used)}
    mlflow.set_tracking_uri(previous)


def test_plain_and_variant_runs_are_told_apart(mixed):
    runs = mixed["runs"].set_index("run_id")
    plain = {name: is_plain(runs.loc[run_id]) for name, run_id in mixed["ids"].items()}
    assert plain == {"baseline": True, "replay": True, "old": True, "fifo": False, "popo": False, "dapo": False,
                     "popo_untagged": False, "stale_failed": False}


def test_results_table_orders_grid_rows_then_variants(mixed):
    ids, results = mixed["ids"], mixed["results"].set_index("run_id")
    order = mixed["results"]["run_id"].tolist()
    # Plain rows as before (baseline, then rho, L, c); then variants by label, then cell.
    assert order == [ids[n] for n in ("baseline", "replay", "old", "dapo", "fifo", "popo", "popo_untagged")]
    assert results["variant"].tolist() == ["Fresh-only", "Replay-RLOO", "Replay", "DAPO dynamic sampling",
                                           "FIFO replay δ=0.5", "POPO", "popo-stale2-c1"]
    assert results["setting"].tolist() == ["Fresh-only", "Replay", "Replay", *["Variant"] * 4]
    old = results.loc[ids["old"]]
    assert (old["rho"], old["L"], old["c"], old["coordinates"]) == (1.0, 2.0, 3.0, "(1, 2, 3)")
    for name in ("fifo", "popo", "dapo", "popo_untagged"):  # no coordinates, whatever the rho/L/c tags say
        row = results.loc[ids[name]]
        assert row["coordinates"] == "-" and pd.isna(row["rho"]) and pd.isna(row["L"]) and pd.isna(row["c"])


def test_variants_table_numbers(mixed):
    ids = mixed["ids"]
    variants = pd.read_csv(mixed["out"] / "variants.csv")
    assert variants.columns.tolist() == tables.VARIANT_COLUMNS
    # References first (baseline, the study's age cell; not the old cell outside the study), then the variants.
    assert variants["run_id"].tolist() == [ids[n] for n in ("baseline", "replay", "dapo", "fifo", "popo",
                                                           "popo_untagged")]
    table = variants.set_index("variant")
    expected = {  # rollouts generated, gradient steps, effective ratio, reward, pass@1, pass@k_max, k_max, protocol
        "Fresh-only": (1024, 4, 0.625, 0.5, 0.4, 0.7, 16, "canonical"),
        "Replay-RLOO": (768, 4, 0.55, 0.52, 0.42, 0.72, 16, "canonical"),
        "DAPO dynamic sampling": (2560, 4, 1.0, 0.7, 0.63, 0.95, 16, "canonical"),
        "FIFO replay δ=0.5": (512, 8, 0.75, 0.66, 0.61, 0.91, 16, "canonical"),
        "POPO": (256, 16, 1.0, 0.58, 0.55, 0.8, 8, "quick"),
    }
    for label, values in expected.items():
        row = table.loc[label]
        assert (row["fresh_evaluations"], row["gradient_steps"], row["effective_ratio"], row["reward"],
                row["pass@1"], row["pass@k_max"], row["k_max"], row["protocol"]) == values, label
    assert table.loc["FIFO replay δ=0.5", "reward_hw"] == 0.02 and pd.isna(table.loc["POPO", "reward_hw"])
    untagged = table.loc["popo-stale2-c1"]
    assert untagged["fresh_evaluations"] == 300 and pd.isna(untagged["gradient_steps"])
    assert pd.isna(untagged["effective_ratio"])


def test_variants_markdown(mixed):
    text = mixed["text"]
    section = text.split("## Variants (SPEC 9)")[1].split("## Budget frontier")[0]
    assert text.index("## Results") < text.index("## Variants (SPEC 9)") < text.index("## Budget frontier")
    assert "(variants.csv)" in section
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].startswith("| variant | cell | rollouts generated | gradient steps | effective ratio | reward |")
    assert rows[1].startswith("| Fresh-only | rho0 | 1024 | 4 | 0.625 | 0.500 ± 0.010 | 0.400 ± 0.020 | ")
    assert "| DAPO dynamic sampling | rho0-dapo | 2560 | 4 | 1.000 | 0.700 ± 0.020 | 0.630 ± 0.030 | " \
           "0.950 ± 0.010 (k=16) | canonical |" in section
    assert "| FIFO replay δ=0.5 | fifo-rho1-N256-with_replacement-pb0.5-c1 | 512 | 8 | 0.750 | 0.660 ± 0.020 |" \
           in section
    assert "| POPO | popo-grpo | 256 | 16 | 1.000 | 0.580 | 0.550 | 0.800 (k=8) | quick |" in section
    assert "| popo-stale2-c1 | popo-stale2-c1 | 300 | - | - |" in section
    # The main results table names the variant of every row; variants have no coordinates.
    assert "| DAPO dynamic sampling | - | rho0-dapo | canonical | 2560 | 4 | 1.000 | 0.630 ± 0.030 |" in text
    assert "| Replay | (1, 2, 3) | rho1-L2-c3 | canonical | 640 | - | - | 0.300 | 0.600 (k=16) |" in text


def test_variants_never_enter_a_heatmap(mixed):
    results, ids = mixed["results"], mixed["ids"]
    variant_ids = {ids[n] for n in ("fifo", "popo", "dapo", "popo_untagged", "stale_failed")}
    for name in tables.GRIDS:
        grid = tables.heatmap_grid(results, name, mixed["unfinished"])
        assert not variant_ids & set(grid["run_id"].dropna())
        assert (grid["unfinished"] == "").all()  # the failed stale-behaviour run is no grid cell's run
        # The FIFO run's tags say rho = 1, L = 2, c = 1: that position stays missing in both grids.
        assert "rho1-L2-c1" in tables.missing_cells(grid)[0]
    age = tables.heatmap_grid(results, "age").set_index("cell")
    assert age.loc["rho1-L1-c1", "run_id"] == ids["replay"] and age.loc["rho1-L2-c3", "run_id"] == ids["old"]
    assert age["run_id"].notna().sum() == 2
    assert "`rho1-L3-c10` (FAILED run)" not in mixed["text"]


def test_rho0_variants_are_no_baseline(mixed):
    results = mixed["results"]
    assert tables.baseline_values(results)["pass@k_max"] == (0.7, 0.01)  # the plain fresh-only run, not DAPO
    # Without the plain fresh-only run there is no baseline at all: DAPO and POPO (rho = 0) never stand in.
    without = results[results["run_id"] != mixed["ids"]["baseline"]]
    assert tables.baseline_values(without) == {}


def test_frontier_labels_each_variant(mixed, tmp_path, monkeypatch):
    """Fig. 3 draws one legend entry per variant label next to the grid's rho/c entries."""
    drawn = {}

    def keep(fig, path):
        legend = fig.axes[0].get_legend() or fig.legends[0]  # with variants it sits below the panels
        drawn["legend"] = [t.get_text() for t in legend.get_texts()]
        return figures.plt.close(fig) or path

    monkeypatch.setattr(figures, "_save", keep)
    figures.plot_frontier(mixed["results"], tmp_path / "f.png", "pass@16")
    assert {"DAPO dynamic sampling", "FIFO replay δ=0.5", "POPO", "popo-stale2-c1"} <= set(drawn["legend"])
    assert "fresh-only (ρ = 0)" in drawn["legend"] and "ρ = 1" in drawn["legend"]


def test_mixed_report_figures_and_variants_sweep_cli(mixed, tmp_path):
    # Two age cells (rho1-L1-c1, rho1-L2-c3) fill that heatmap; no evaluation logged unique_rate: no diversity figure.
    for name in ["frontier.png", "dynamics.png", "heatmap_age.png"]:
        _assert_png(mixed["out"] / name)
    assert not (mixed["out"] / "diversity.png").exists() and not (mixed["out"] / "heatmap_ratio.png").exists()
    assert "_Figure left out: no final evaluation logged `unique_rate`._" in mixed["text"]
    assert report.main(["--experiment", EXPERIMENT, "--sweep", "variants", "--out", str(tmp_path),
                        f"tracking.uri={mixed['uri']}"]) == 0
    for name in ["frontier.png", "dynamics.png"]:
        _assert_png(tmp_path / name)
    text = (tmp_path / "report.md").read_text()
    assert "## Variants (SPEC 9)" in text and f"`{mixed['ids']['old']}`" not in text
    # The variants sweep finds its reference cells through the `sweeps` tag.
    assert pd.read_csv(tmp_path / "variants.csv")["cell"].tolist()[:2] == ["rho0", "rho1-L1-c1"]


def test_variants_sweep_without_variant_runs_still_has_the_section(mixed, tmp_path):
    runs = mixed["runs"]
    plain = runs[[is_plain(run) for _, run in runs.iterrows()]]
    text = report.write_report(plain, tmp_path, mixed["client"], sweeps=["variants"]).read_text()
    section = text.split("## Variants (SPEC 9)")[1].split("## Budget frontier")[0]
    assert "_No finished variant runs yet._" in section and "| Fresh-only | rho0 | 1024 |" in section


# --------------------------------------------------------------------------- one label, two configurations

def test_same_label_with_another_config_is_flagged_and_since_keeps_the_newer(tmp_path_factory, capsys):
    """A warm start rebuilt between two runs of one cell: two experiments under one label, not a repeat."""
    folder, uri, client, experiment_id = _new_store(tmp_path_factory, "relabel")
    previous = mlflow.get_tracking_uri()
    t0 = int(time.time() * 1000) - 3_600_000
    old = _log_run(client, experiment_id, started=t0, sweep="age", rho=1, L=1, c=1, tags={"cell_id": "old0config"},
                   final={"quick": NEW_C1_QUICK})
    new = _log_run(client, experiment_id, started=t0 + 1_800_000, sweep="age", rho=1, L=1, c=1,
                   tags={"cell_id": "new0config"}, final={"quick": {**NEW_C1_QUICK, "mean_reward": 0.5}})
    try:
        everything = tmp_path_factory.mktemp("all")
        assert report.main(["--experiment", EXPERIMENT, "--out", str(everything), f"tracking.uri={uri}"]) == 0
        table = pd.read_csv(everything / "results_table.csv")
        assert table.set_index("run_id").loc[[new, old], "cell_id"].tolist() == ["new0config", "old0config"]
        shared = tables.same_label_configs(table)
        assert set(shared["run_id"]) == {old, new}
        text = (everything / "report.md").read_text()
        assert "Same label, different configuration" in text and f"`{old}`" in text and "`old0config`" in text

        # Between the two starts, in the local time the report prints.
        between = datetime.fromtimestamp((t0 + 900_000) / 1000).strftime("%Y-%m-%dT%H:%M")
        newer = tmp_path_factory.mktemp("newer")
        assert report.main(["--experiment", EXPERIMENT, "--since", between, "--out", str(newer),
                            f"tracking.uri={uri}"]) == 0
        assert "1 run(s)" in capsys.readouterr().out
        assert pd.read_csv(newer / "results_table.csv")["run_id"].tolist() == [new]
        assert "Same label" not in (newer / "report.md").read_text()

        with pytest.raises(SystemExit) as exit_info:
            report.main(["--experiment", EXPERIMENT, "--since", "last week", f"tracking.uri={uri}"])
        assert exit_info.value.code != 0
        assert "'last week' is not a date" in capsys.readouterr().err

        runs = load_runs(uri, EXPERIMENT, since=datetime.fromtimestamp((t0 + 1_800_000) / 1000))
        assert runs["run_id"].tolist() == [new]  # a run started exactly at `since` is kept
    finally:
        mlflow.set_tracking_uri(previous)
