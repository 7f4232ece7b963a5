"""Studies as sweeps: cell identity, the launch plan, skipping finished cells, and resuming a pre-empted run."""

from __future__ import annotations

import signal
import subprocess
import sys

import mlflow
import pytest

from tests.conftest import wall_clock
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from src.paths import CONFIG_DIR, PROJECT_ROOT
from src.runs.cells import CellRuns
from src.study.sweep import cell_identity, plan_cells
from tests.preemption import sigterm_after_first_checkpoint


# --------------------------------------------------------------------------- identity
def test_identity_ignores_launch_only_keys(compose_config):
    base = cell_identity(compose_config("buffer=age2", "clip=tight"))
    same = cell_identity(compose_config("buffer=age2", "clip=tight", "tracking.uri=http://x:5000",
                                        "tracking.sweep=other", "trainer.checkpoint_every=3",
                                        "trainer.resume_from=/tmp/c.pt", "hardware.threads=1"))
    assert base == same


def test_identity_separates_cells_and_seeds(compose_config):
    cells = [("buffer=age2", "clip=tight"), ("buffer=age2", "clip=mid"), ("buffer=age1", "clip=tight"),
             ("buffer=age2", "clip=tight", "buffer.ratio=2"), ("buffer=age2", "clip=tight", "trainer.seed=1"),
             ("buffer=age2", "clip=tight", "trainer.steps=7")]
    identities = [cell_identity(compose_config(*cell)) for cell in cells]
    assert len(set(identities)) == len(cells)


def test_identity_does_not_depend_on_how_a_number_is_written(compose_config):
    assert cell_identity(compose_config("buffer=age2", "buffer.ratio=1")) == cell_identity(
        compose_config("buffer=age2", "buffer.ratio=1.0"))


def test_fresh_only_cells_ignore_buffer_and_clip(compose_config):
    """The ratio study's rho=0 baseline is the baseline study's buffer=none cell."""
    assert cell_identity(compose_config("buffer=none", "clip=loose")) == cell_identity(
        compose_config("buffer=age2", "buffer.ratio=0", "clip=tight"))


# --------------------------------------------------------------------------- the studies
def study_jobs(name: str, *arguments: str):
    """Every job (overrides, composed config) of a study, as the sweeper expands it."""
    from hydra_plugins.replay_rloo_sweeper import SkipFinishedSweeper

    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        grids = compose("config", overrides=[f"+sweep={name}"], return_hydra_config=True).hydra.sweeper.grids
        sweeper = SkipFinishedSweeper(grids=grids)

        class Context:  # the sweeper only needs the parser's config loader, which the grammar ignores here
            config_loader = None

        sweeper.hydra_context = Context()
        jobs = sweeper.job_overrides([f"+sweep={name}", *arguments])
        return [(job, compose("config", overrides=list(job))) for job in jobs]


@pytest.mark.parametrize("study, jobs, launched", [("baseline", 1, 1), ("age", 9, 9), ("ratio", 13, 13),
                                                   ("stress", 1, 1), ("paper", 23, 20)])
def test_study_sizes(study, jobs, launched):
    planned = plan_cells(study_jobs(study), CellRuns({}, {}))
    assert len(planned) == jobs
    assert sum(cell.status == "launch" for cell in planned) == launched  # paper: shared cells once


def test_ratio_study_cells_and_budgets():
    planned = plan_cells(study_jobs("ratio", "trainer=paper"), CellRuns({}, {}))
    budgets = {cell.cell: cell.fresh_evaluations for cell in planned}
    assert budgets["rho0"] == 102_400 and budgets["rho0.5-L2-c1"] == 68_344 and budgets["rho2-L2-c10"] == 35_080
    assert {cell.cell for cell in planned} >= {f"rho{r}-L2-c{c}" for r in ("0.5", "1", "1.5", "2") for c in (1, 3, 10)}


def test_command_line_wins_over_the_grid():
    jobs = study_jobs("stress", "trainer.steps=5")
    assert [cfg.trainer.steps for _, cfg in jobs] == [5]


def test_finished_and_resumable_cells_are_marked():
    jobs = study_jobs("age")
    done, broken = cell_identity(jobs[0][1]), cell_identity(jobs[1][1])
    planned = plan_cells(jobs, CellRuns({done: "run-a"}, {broken: "/x/checkpoint.pt"}))
    assert [cell.status for cell in planned[:3]] == ["finished", "resume", "launch"]
    assert planned[0].previous == "run-a" and planned[1].previous == "/x/checkpoint.pt"


# --------------------------------------------------------------------------- end to end, basic launcher
def tiny_cli(tmp_path, policy_dir, *overrides, experiment="replay-rloo", multirun=False):
    defaults = [f"policy.name_or_path={policy_dir}", f"tracking.uri={store(tmp_path)}",
                f"tracking.artifact_location={tmp_path}/artifacts", f"tracking.experiment={experiment}",
                f"hydra.sweep.dir={tmp_path}/multirun", "trainer.groups_per_step=4", "trainer.group_size=2",
                "policy.max_new_tokens=6", "evaluation.at_start=false", "evaluation.prompts=2",
                "evaluation.samples_per_prompt=2", "evaluation.ks=[1]"]
    given = {word.split("=", 1)[0] for word in overrides}  # an override replaces its default: a key given twice is refused
    return [sys.executable, "-m", "src.run", *(["-m"] if multirun else []),
            *(word for word in defaults if word.split("=", 1)[0] not in given), *overrides]


def store(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/mlruns.db"


def run(command, **kwargs):
    result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.long  # make test-long (docs/testing.md): test_slurm_sweep's sweep is relaunched and skipped in the suite
def test_relaunched_sweep_skips_finished_cells(tmp_path, random_policy_dir):
    sweep = tiny_cli(tmp_path, random_policy_dir, "buffer=none,age1", "clip=tight", "trainer.steps=2",
                     "tracking.sweep=grid", multirun=True)
    first = run(sweep)
    assert "2 to launch" in first
    mlflow.set_tracking_uri(store(tmp_path))
    runs = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert sorted(runs["status"]) == ["FINISHED", "FINISHED"] and runs["tags.cell_id"].nunique() == 2

    again = run([*sweep[:-1], "tracking.sweep=other"])  # a second study sharing both cells
    assert "2 finished (skipped)" in again and "0 to launch" in again
    runs = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert len(runs) == 2  # nothing ran twice
    assert set(runs["tags.sweeps"]) == {",grid,other,"}  # the other study's report finds them

    dry = run([*tiny_cli(tmp_path, random_policy_dir, "buffer=none,age1,age2", *sweep[-3:], multirun=True),
               "hydra.sweeper.dry_run=true"])
    assert "DRY RUN" in dry and "1 to launch" in dry and "2 finished" in dry


@pytest.mark.slow
def test_preempted_run_resumes_into_the_same_run_with_identical_metrics(tmp_path, random_policy_dir):
    """SIGTERM after a checkpoint: the job checkpoints, is marked KILLED, and a relaunch continues it exactly."""
    cell = ["buffer=age1", "clip=tight", "trainer.steps=6", "trainer.checkpoint_every=1", "tracking.sweep=preempt"]
    run([*tiny_cli(tmp_path, random_policy_dir, *cell, experiment="reference"), f"hydra.run.dir={tmp_path}/ref"])

    command = [*tiny_cli(tmp_path, random_policy_dir, *cell), f"hydra.run.dir={tmp_path}/first"]
    returncode, output = sigterm_after_first_checkpoint(command, tmp_path / "first" / "checkpoint.pt")
    assert returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "marked KILLED" in output
    mlflow.set_tracking_uri(store(tmp_path))
    killed = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(killed["status"]) == ["KILLED"]
    steps_done = len(MlflowClient(store(tmp_path)).get_metric_history(killed.run_id[0], "train/reward"))
    assert 1 <= steps_done < 6

    resumed_log = run([*tiny_cli(tmp_path, random_policy_dir, *cell), f"hydra.run.dir={tmp_path}/second"])
    assert "resuming run" in resumed_log
    after = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(after["status"]) == ["FINISHED"] and after.run_id[0] == killed.run_id[0]

    reference = mlflow.search_runs(experiment_names=["reference"]).run_id[0]
    client = MlflowClient(store(tmp_path))
    keys = [key for key in client.get_run(reference).data.metrics if not wall_clock(key)]
    assert "train/reward" in keys and "weights/ess" in keys and "quick/final/mean_reward" in keys
    for key in keys:
        expected = [(m.step, m.value) for m in sorted(client.get_metric_history(reference, key), key=lambda m: m.step)]
        actual = [(m.step, m.value) for m in sorted(client.get_metric_history(after.run_id[0], key),
                                                    key=lambda m: m.step)]
        assert [step for step, _ in actual] == [step for step, _ in expected], key
        assert [value for _, value in actual] == pytest.approx([value for _, value in expected], rel=1e-5), key


def test_a_rebuilt_local_policy_is_a_new_cell_and_a_hub_name_is_its_own_identity(compose_config, tmp_path):
    """Rebuilding the warm start under the same folder must not let the sweeper skip cells trained from the old one."""
    from src.study.sweep import policy_fingerprint

    folder = tmp_path / "policy"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights one")
    cfg = compose_config(f"policy.name_or_path={folder}")
    first = cell_identity(cfg)
    assert cell_identity(cfg) == first  # stable
    (folder / "model.safetensors").write_bytes(b"weights two")
    assert cell_identity(cfg) != first
    assert policy_fingerprint("some-org/some-hub-model") is None
    assert policy_fingerprint("checkpoints/tiny-countdown") is not None  # the committed folder, from the root


# --------------------------------------------------------------------------- training-seed repeats
def test_seeds_of_a_cell_are_separate_jobs_with_one_cell_key():
    """trainer.seed=0,1,2: three jobs (three cell_ids) sharing everything else (one cell_key), each skipped or
    resumed on its own."""
    from src.study.sweep import cell_key

    jobs = study_jobs("baseline", "trainer.seed=0,1,2")
    assert [cfg.trainer.seed for _, cfg in jobs] == [0, 1, 2]
    assert len({cell_identity(cfg) for _, cfg in jobs}) == 3
    assert len({cell_key(cfg) for _, cfg in jobs}) == 1
    # Everything but the seed is the same config.
    from omegaconf import OmegaConf
    first, *rest = [OmegaConf.to_container(cfg, resolve=True) for _, cfg in jobs]
    for other in rest:
        other["trainer"]["seed"] = first["trainer"]["seed"]
        assert other == first

    seed0, seed1 = cell_identity(jobs[0][1]), cell_identity(jobs[1][1])
    planned = plan_cells(jobs, CellRuns({seed0: "run-seed0"}, {seed1: "/x/checkpoint.pt"}))
    assert [(cell.seed, cell.status) for cell in planned] == [(0, "finished"), (1, "resume"), (2, "launch")]
    assert {cell.cell for cell in planned} == {"rho0"}  # the name is the cell's; the seed is its own column and tag


def test_seed_keys_differ_between_cells(compose_config):
    from src.study.sweep import cell_key

    assert cell_key(compose_config("buffer=age1", "clip=tight")) != cell_key(compose_config("buffer=age1", "clip=mid"))
    assert cell_key(compose_config("buffer=age1", "trainer.seed=4")) == cell_key(compose_config("buffer=age1"))


def test_make_seeds_adds_the_seed_axis_and_refuses_a_bad_count():
    def make(*arguments):
        return subprocess.run(["make", "-n", "sweep-age", *arguments], cwd=PROJECT_ROOT, capture_output=True,
                              text=True, timeout=60)

    command = [line for line in make("SEEDS=3").stdout.splitlines() if "src.run" in line][0]
    assert "trainer.seed=0,1,2" in command.split()
    assert "trainer.seed=" not in [line for line in make().stdout.splitlines() if "src.run" in line][0]
    assert "trainer.seed=7,8" in make("SEEDS=2", "SEED_BASE=7").stdout
    refused = make("SEEDS=three")
    assert refused.returncode != 0 and "SEEDS=three" in refused.stderr and "whole number" in refused.stderr


@pytest.mark.slow
@pytest.mark.long  # make test-long (docs/testing.md): the reproduction test runs two seeds
def test_two_seed_sweep_runs_each_seed_once_and_tags_it(tmp_path, random_policy_dir):
    sweep = tiny_cli(tmp_path, random_policy_dir, "buffer=age1", "clip=tight", "trainer.steps=2",
                     "trainer.seed=0,1", "tracking.sweep=seeds", multirun=True)
    dry = run([*sweep, "hydra.sweeper.dry_run=true"])
    assert "DRY RUN" in dry and "2 to launch" in dry
    first = run(sweep)
    assert "2 to launch" in first
    mlflow.set_tracking_uri(store(tmp_path))
    runs = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert sorted(runs["status"]) == ["FINISHED", "FINISHED"]
    assert sorted(runs["tags.seed"]) == ["0", "1"]
    assert runs["tags.cell_id"].nunique() == 2 and runs["tags.cell_key"].nunique() == 1
    assert set(runs["tags.cell"]) == {"rho1-L1-c1"}
    # The two seeds trained differently (different rollouts), from the same config otherwise.
    client = MlflowClient(store(tmp_path))
    entropies = [[m.value for m in client.get_metric_history(run_id, "train/entropy")] for run_id in runs["run_id"]]
    assert entropies[0] != entropies[1]

    three_seeds = [o if o != "trainer.seed=0,1" else "trainer.seed=0,1,2" for o in sweep]
    again = run([*three_seeds, "hydra.sweeper.dry_run=true"])
    assert "1 to launch" in again and "2 finished" in again
