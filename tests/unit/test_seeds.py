"""analysis.seeds: intervals over training seeds, paired differences to fresh-only and their verdicts.

The numbers are worked by hand (t quantiles: t_0.975 with 1 degree of freedom is 12.7062, with 2 is 4.30265).
"""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from analysis import report, seeds, tables
from analysis.runs import load_runs, select_cells
from tests.unit.test_report import _log_run, _new_store

T_975_DF1, T_975_DF2 = 12.706205, 4.302653


def test_t_interval_over_three_seeds():
    mean, half_width = seeds.t_interval([0.2, 0.3, 0.4])
    # sd 0.1, standard error 0.1 / sqrt(3) = 0.0577350
    assert mean == pytest.approx(0.3) and half_width == pytest.approx(T_975_DF2 * 0.1 / np.sqrt(3), rel=1e-6)
    assert half_width == pytest.approx(0.248414, abs=1e-6)


def test_one_value_has_no_interval():
    mean, half_width = seeds.t_interval([0.42])
    assert mean == 0.42 and np.isnan(half_width)
    assert all(np.isnan(seeds.t_interval([])))


def test_evaluation_repeats_are_averaged_within_a_seed_first():
    """Seed 0 has two repeats (0.2, 0.4) and seed 1 one (0.5): the mean over seeds is (0.3 + 0.5) / 2 = 0.4,
    not the pooled 0.3667, and n is 2 seeds, not 3 repeats."""
    table = pd.DataFrame({"seed": [0, 0, 1], "reward": [0.2, 0.4, 0.5]})
    summary = seeds.over_seeds(table, "reward")
    assert summary["n_seeds"] == 2 and summary["mean"] == pytest.approx(0.4)
    # sd of (0.3, 0.5) is 0.141421, standard error 0.1, t with 1 degree of freedom
    assert summary["hw"] == pytest.approx(T_975_DF1 * 0.1, rel=1e-6)


def test_paired_difference_better():
    """Differences 0.05, 0.06, 0.07: mean 0.06, sd 0.01, t = 0.06 / (0.01 / sqrt 3) = 10.392, p = 0.00913."""
    baseline = pd.Series([0.30, 0.31, 0.29], index=[0, 1, 2])
    cell = pd.Series([0.35, 0.37, 0.36], index=[0, 1, 2])
    result = seeds.paired_difference(cell, baseline)
    assert result["n_pairs"] == 3 and result["diff"] == pytest.approx(0.06)
    assert result["diff_hw"] == pytest.approx(T_975_DF2 * 0.01 / np.sqrt(3), rel=1e-6)
    assert result["p_value"] == pytest.approx(0.00913, abs=5e-5)
    assert result["verdict"] == "better"
    assert seeds.paired_difference(baseline, cell)["verdict"] == "worse"


def test_paired_difference_within_noise():
    """Differences 0.05, 0.06, 0.01: mean 0.04, sd 0.026458, t = 2.619, p = 0.120: the interval holds 0."""
    result = seeds.paired_difference(pd.Series([0.30, 0.32, 0.28]), pd.Series([0.25, 0.26, 0.27]))
    assert result["diff"] == pytest.approx(0.04)
    assert result["diff_hw"] == pytest.approx(T_975_DF2 * 0.0264575 / np.sqrt(3), rel=1e-5)
    assert result["p_value"] == pytest.approx(0.1200, abs=5e-4)
    assert result["diff"] - result["diff_hw"] < 0 < result["diff"] + result["diff_hw"]
    assert result["verdict"] == "within noise"


def test_pairs_are_by_seed_and_one_pair_is_one_seed():
    """Only the seeds both cells have pair up; the baseline's seed order does not matter."""
    cell = pd.Series([0.40, 0.50], index=[3, 7])
    baseline = pd.Series([0.10, 0.30, 0.20], index=[7, 3, 9])
    result = seeds.paired_difference(cell, baseline)
    assert result["n_pairs"] == 2 and result["diff"] == pytest.approx(((0.40 - 0.30) + (0.50 - 0.10)) / 2)
    single = seeds.paired_difference(pd.Series([0.4], index=[0]), pd.Series([0.3], index=[0]))
    assert single["verdict"] == "one seed" and single["diff"] == pytest.approx(0.1) and np.isnan(single["diff_hw"])
    assert seeds.paired_difference(pd.Series([0.4], index=[1]), pd.Series([0.3], index=[0]))["verdict"] == "no baseline"


def test_identical_differences_have_no_spread():
    shifted = seeds.paired_difference(pd.Series([0.4, 0.5]), pd.Series([0.3, 0.4]))
    assert shifted["verdict"] == "better"
    same = seeds.paired_difference(pd.Series([0.4, 0.5]), pd.Series([0.4, 0.5]))
    assert same["verdict"] == "within noise"


def _results(rows):
    """A results table (analysis.report.results_table's columns that seed_table reads)."""
    base = {"plain": True, "setting": "Replay", "policy": "tiny", "protocol": "quick", "k_max": 8,
            "fresh_evaluations": 100.0}
    table = pd.DataFrame([{**base, **row} for row in rows])
    for metric in seeds.SUMMARY_COLUMNS:
        if metric not in table:
            table[metric] = np.nan
        table[metric + "_hw"] = table.get(metric + "_hw", np.nan)
    return table


def test_seed_table_rows_and_verdicts():
    fresh = [{"cell_key": "f", "cell": "rho0", "variant": "Fresh-only", "coordinates": "(0, -, -)", "rho": 0.0,
              "L": np.nan, "c": np.nan, "seed": s, "run_id": f"f{s}", "reward": r, "pass@1": 0.1}
             for s, r in zip([0, 1, 2], [0.30, 0.31, 0.29])]
    replay = [{"cell_key": "r", "cell": "rho1-L1-c1", "variant": "Replay-RLOO", "coordinates": "(1, 1, 1)",
               "rho": 1.0, "L": 1.0, "c": 1.0, "seed": s, "run_id": f"r{s}", "reward": r, "pass@1": 0.1}
              for s, r in zip([0, 1, 2], [0.35, 0.37, 0.36])]
    table = seeds.seed_table(_results(fresh + replay)).set_index("cell_key")
    assert table.loc["f", "is_baseline"] and not table.loc["r", "is_baseline"]
    assert table.loc["r", "n_seeds"] == 3 and table.loc["r", "seeds"] == "0,1,2"
    assert table.loc["r", "reward"] == pytest.approx(0.36)
    assert table.loc["r", "reward_hw"] == pytest.approx(T_975_DF2 * 0.01 / np.sqrt(3), rel=1e-6)
    assert table.loc["r", "reward_diff"] == pytest.approx(0.06) and table.loc["r", "reward_verdict"] == "better"
    assert table.loc["r", "pass@1_verdict"] == "within noise"  # identical values: a zero difference
    assert pd.isna(table.loc["f"].get("reward_verdict"))  # the reference has no difference to itself


def test_one_seed_keeps_the_runs_own_interval_and_says_one_seed():
    rows = [{"cell_key": "f", "cell": "rho0", "variant": "Fresh-only", "coordinates": "(0, -, -)", "rho": 0.0,
             "seed": 0, "run_id": "f0", "reward": 0.3, "reward_hw": 0.02},
            {"cell_key": "r", "cell": "rho1-L1-c1", "variant": "Replay-RLOO", "coordinates": "(1, 1, 1)", "rho": 1.0,
             "L": 1.0, "c": 1.0, "seed": 0, "run_id": "r0", "reward": 0.25, "reward_hw": 0.03}]
    table = seeds.seed_table(_results(rows)).set_index("cell_key")
    assert table.loc["r", "reward"] == 0.25 and table.loc["r", "reward_hw"] == 0.03  # the evaluation repeats' hw
    assert table.loc["r", "reward_verdict"] == "one seed" and table.loc["r", "reward_diff"] == pytest.approx(-0.05)


def test_seed_bands_mean_min_max_per_cell():
    results = pd.DataFrame({"run_id": ["a0", "a1", "b0"], "cell_key": ["a", "a", "b"]})
    history = pd.DataFrame({"run_id": ["a0", "a1", "a0", "a1", "b0"], "key": ["k"] * 5, "step": [0, 0, 1, 1, 0],
                            "value": [1.0, 3.0, 2.0, 6.0, 5.0]})
    bands = seeds.seed_bands(history, results)
    a = bands[bands["run_id"] == "a0"].set_index("step")
    assert list(a["value"]) == [2.0, 4.0] and list(a["low"]) == [1.0, 2.0] and list(a["high"]) == [3.0, 6.0]
    assert list(a["n_seeds"]) == [2, 2]
    b = bands[bands["run_id"] == "b0"]
    assert list(b["value"]) == [5.0] and list(b["low"]) == list(b["high"]) == [5.0]


# --------------------------------------------------------------------------- the report over a store
QUICK = {"pass_at_1": 0.2, "pass_at_8": 0.4, "correction_rate": 0.2, "unique_rate": 0.3}


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """Fresh-only, rho1-L1-c1 (better) and rho1-L1-c3 (within noise) at training seeds 0, 1, 2."""
    folder, uri, client, experiment_id = _new_store(tmp_path_factory, "seeded")
    started = int(time.time() * 1000) - 3_600_000
    cells = {("rho0", 0.0, 0, 1.0): [0.30, 0.31, 0.29], ("rho1-L1-c1", 1.0, 1, 1.0): [0.35, 0.37, 0.36],
             ("rho1-L1-c3", 1.0, 1, 3.0): [0.31, 0.30, 0.31]}
    for (cell, rho, L, c), rewards in cells.items():
        for seed, reward in enumerate(rewards):
            started += 1000
            _log_run(client, experiment_id, started=started, sweep="seeds", rho=rho, L=L, c=c, fresh=1000,
                     final={"quick": {**QUICK, "mean_reward": reward}},
                     tags={"cell_key": cell, "seed": str(seed), "cell_id": f"{cell}-{seed}"},
                     per_step={"train/reward": [reward + 0.01 * seed * step for step in range(4)]})
    return folder, uri, client


def test_report_aggregates_seeds_and_names_the_verdicts(seeded, tmp_path):
    _, uri, client = seeded
    runs = load_runs(uri, "report-test")
    path = report.write_report(runs, tmp_path, client)
    text = path.read_text()
    assert "## Across training seeds" in text and seeds.TEST_NAME in text
    assert "Same label, different configuration" not in text  # seeds of a cell are repeats, not other configs
    cells = pd.read_csv(tmp_path / "seeds.csv").set_index("cell")
    assert cells.loc["rho1-L1-c1", "n_seeds"] == 3 and cells.loc["rho1-L1-c1", "reward_verdict"] == "better"
    assert cells.loc["rho1-L1-c1", "reward_diff"] == pytest.approx(0.06)
    assert cells.loc["rho1-L1-c3", "reward_verdict"] == "within noise"
    assert cells.loc["rho1-L1-c3", "reward"] == pytest.approx((0.31 + 0.30 + 0.31) / 3)
    line = next(row for row in text.splitlines() if "rho1-L1-c1" in row and "3 (0,1,2)" in row)
    assert "+0.060 ± 0.025" in line and "better" in line
    # The heatmap cell of c = 3 is marked as noise; the grid holds the means over seeds.
    grid = tables.heatmap_grid(seeds.seed_table(tables.results_table(select_cells(runs)[0])), "age")
    c3 = grid[(grid["row"] == 1) & (grid["col"] == 3)].iloc[0]
    assert c3["reward_verdict"] == "within noise" and c3["reward"] == pytest.approx(0.30667, abs=1e-5)
    assert (tmp_path / "dynamics.png").stat().st_size > 0


def test_report_with_one_seed_per_cell_says_one_seed(tmp_path_factory, tmp_path):
    _, uri, client, experiment_id = _new_store(tmp_path_factory, "oneseed")
    started = int(time.time() * 1000) - 3_600_000
    _log_run(client, experiment_id, started=started, sweep="s", rho=0.0, L=0, c=1.0,
             final={"quick": {**QUICK, "mean_reward": 0.3}})
    _log_run(client, experiment_id, started=started + 1000, sweep="s", rho=1.0, L=1, c=1.0,
             final={"quick": {**QUICK, "mean_reward": 0.25, "mean_reward_hw": 0.02}})
    runs = load_runs(uri, "report-test")  # logged without seed or cell_key tags (older runs)
    text = report.write_report(runs, tmp_path, client).read_text()
    line = next(row for row in text.splitlines() if "rho1-L1-c1" in row and "1 (0)" in row)
    assert "one seed" in line and "-0.050" in line and "± 0.0" not in line.split("|")[6]
    results = pd.read_csv(tmp_path / "results_table.csv")
    assert results.loc[results["cell"] == "rho1-L1-c1", "reward_hw"].iloc[0] == pytest.approx(0.02)


def test_seeds_under_different_protocols_are_not_averaged_together():
    rows = [{"cell_key": "f", "cell": "rho0", "variant": "Fresh-only", "coordinates": "(0, -, -)", "rho": 0.0,
             "seed": s, "run_id": f"f{s}", "reward": 0.3, "protocol": protocol}
            for s, protocol in [(0, "quick"), (1, "quick"), (2, "canonical")]]
    table = seeds.seed_table(_results(rows))
    assert sorted(zip(table["protocol"], table["n_seeds"])) == [("canonical", 1), ("quick", 2)]
