"""The `experiment` group (conf/experiment/, `+experiment=seedNNN-...`): each paper's setting in one command.

Every value a preset sets from its paper is pinned here against the paper's own number, with the line of
the paper it comes from ("seed 001 line 2290"; docs/papers.md says what the cited passages fix), so a
preset cannot drift from its paper unnoticed. Tiny variants keep the paper's ratios at CPU scale; they
validate, and (slow) each runs a step.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from src.command.config import validate
from src.paths import CONFIG_DIR, PROJECT_ROOT

# "seed 001 line 2290": a line of the paper's plain text (docs/papers.md lists what each cited line says).
S000, S001, S002, S003, S004 = ("seed 000 line", "seed 001 line", "seed 002 line", "seed 003 line", "seed 004 line")
RLEP, RLEP_SCRIPT = "RLEP section", "RLEP's recipe/rlep/rlep_training.sh l."
M2PO_SCRIPT = "M2PO's train-scripts/m2po-qwen-math-7b-s256.sh l."

ONPOLICY_002 = {  # seed 002 Table 1's on-policy RLOO (line 140) and what every row of it shares (line 121)
    "trainer.steps": (60, f"{S002} 121"),
    "trainer.groups_per_step": (32, f"{S002} 121"),
    "trainer.group_size": (8, f"{S002} 121"),
    "trainer.micro_batch_size": (32 * 8 // 16, f"{S002} 121"),  # gradient accumulation 16
    "trainer.learning_rate": (5e-6, f"{S002} 121"),
    "trainer.entropy_coef": (1e-3, f"{S002} 121"),
    "trainer.kl_coef": (0.02, f"{S002} 121"),
    "buffer.name": ("none", f"{S002} 140"),  # on-policy RLOO
    "behaviour.name": ("current", f"{S002} 140"),
    "loss.name": ("rloo-tis", f"{S002} 85-89"),
    "loss.is_max": (10.0, f"{S002} 121"),
}

# preset -> {dotted key: (the paper's value, where it says so)}
PAPERS = {
    "seed000-countdown": {
        "policy.name_or_path": ("amulyaparthasarathy/qwen-sft-countdown", f"{S000} 304"),
        "trainer.group_size": (8, f"{S000} 305"),
        "trainer.groups_per_step": (128, f"{S000} 306"),
        "trainer.steps": (100, f"{S000} 307"),
        "trainer.learning_rate": (1e-5, f"{S000} 308"),
        "trainer.weight_decay": (1e-4, f"{S000} 309"),
        "trainer.kl_coef": (1e-3, f"{S000} 310"),
        "trainer.entropy_coef": (1e-3, f"{S000} 311"),
        "trainer.max_grad_norm": (None, f"{S000} 312"),
        "trainer.rollout.temperature": (1.0, f"{S000} 313"),
        "trainer.rollout.top_p": (1.0, f"{S000} 313"),
        "trainer.rollout.top_k": (None, f"{S000} 313"),
        "policy.max_new_tokens": (1024, f"{S000} 313"),
        "loss.name": ("rloo", f"{S000} 90"),
        "clip.ceiling": (10, f"{S000} 98"),
        "buffer.capacity": (4096 * 8, f"{S000} 318"),  # 4096 groups of K = 8, in rollouts
        "evaluation.temperature": (0.6, f"{S000} 320"),
        "evaluation.top_p": (0.95, f"{S000} 320"),
        "evaluation.top_k": (20, f"{S000} 320"),
        "evaluation.samples_per_prompt": (16, f"{S000} 321"),
        "evaluation.prompts": (50, f"{S000} 100"),
        "evaluation.repeats": (5, f"{S000} 100"),
        "policy.vllm.max_model_len": (2048, f"{S000} 322"),
        "hardware.name": ("h100", f"{S000} 106"),
    },
    "seed001-async": {
        "policy.name_or_path": ("Qwen/Qwen3-0.6B", f"{S001} 412-415"),
        "task.preset": ("openr1", f"{S001} 413"),
        "runtime.name": ("async", f"{S001} 86-124"),
        "loss.name": ("grpo-coupled", f"{S001} 2292-2330"),
        "loss.eps_low": (0.2, f"{S001} 2332"),
        "loss.eps_high": (0.2, f"{S001} 2332"),
        "trainer.kl_coef": (0.0, f"{S001} 2331-2332"),
        "trainer.entropy_coef": (0.0, f"{S001} 2292-2330"),  # the objective has no entropy term
        "trainer.group_size": (16, f"{S001} 2332-2333"),
        "buffer.batch_rollouts": (60, f"{S001} 2287-2288"),
        "trainer.learning_rate": (3.37e-7, f"{S001} 2290"),
        "trainer.weight_decay": (0.0, f"{S001} 2287"),  # Adam
        "trainer.rollout.temperature": (1.0, f"{S001} 2360"),
        "evaluation.temperature": (0.1, f"{S001} 2360"),
        "evaluation.top_p": (0.95, f"{S001} 2360"),
        "buffer.capacity": (252, f"{S001} 111-112"),
        "buffer.mode": ("without_replacement", f"{S001} 777-779"),  # random.sample: distinct
        "buffer.positive_bias": (0.0, f"{S001} 411-412"),
        "runtime.mu": (6.84, f"{S001} 2452"),
        "buffer.sharded": (True, f"{S001} 2465-2470"),
        "runtime.staleness": (None, f"{S001} 2286-2362"),  # no bound
        "hardware.name": ("h100x8", f"{S001} 2264-2266"),
    },
    "seed002-onpolicy": ONPOLICY_002,
    "seed002-replay": {  # the on-policy settings, and the buffer of Algorithm 1
        **{key: value for key, value in ONPOLICY_002.items() if not key.startswith(("buffer.", "behaviour."))},
        "trainer.checkpoint_every": (5, f"{S002} 121"),
        "buffer.name": ("fifo", f"{S002} 83"),
        "buffer.capacity": (1024 * 8, f"{S002} 121"),  # 1024 groups (its unit blank) of K = 8, in rollouts
        "buffer.ratio": (0.0, f"{S002} 97-108"),
        "buffer.extra_updates": (2 - 1, f"{S002} 142"),  # R = 2
        "loss.is_level": ("sequence", f"{S002} 85"),
    },
    "seed002-aggressive": {
        "trainer.steps": (60, f"{S002} 121"),
        "trainer.groups_per_step": (32, f"{S002} 121"),
        "trainer.group_size": (8, f"{S002} 121"),
        "trainer.learning_rate": (5e-6, f"{S002} 121"),
        "trainer.kl_coef": (0.02, f"{S002} 121"),
        "buffer.extra_updates": (4 - 1, f"{S002} 147"),  # R = 4
        "behaviour.name": ("stale", f"{S002} 147"),
        "behaviour.lag": (4, f"{S002} 147"),
        "loss.is_level": ("token", f"{S002} 147"),
        "loss.is_max_token": (2.0, f"{S002} 121"),
    },
    "seed003-deepscaler": {
        "policy.name_or_path": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", f"{S003} 66"),
        "task.preset": ("deepscaler", f"{S003} 66"),
        "task.verifier.format_reward": (0.0, f"{S003} 270"),  # binary reward
        "policy.max_new_tokens": (8192, f"{S003} 270"),
        "trainer.groups_per_step": (256, f"{S003} 270"),
        "trainer.entropy_coef": (0.0, f"{S003} 270"),
        "trainer.kl_coef": (0.0, f"{S003} 269"),
        "buffer.name": ("popo", f"{S003} 269"),
        "loss.name": ("grpo", f"{S003} 269"),
        "hardware.name": ("h100x8", f"{S003} 270"),  # 8 A100s: the 8-GPU node preset
    },
    "seed003-countdown": {
        "policy.name_or_path": ("Qwen/Qwen2.5-3B", f"{S003} 67"),
        "task.dataset": ("Jiayi-Pan/Countdown-Tasks-3to4", f"{S003} 67"),
        "task.train_size": (20000, f"{S003} 67"),
        "policy.max_new_tokens": (1024, f"{S003} 270"),
        "trainer.groups_per_step": (256, f"{S003} 270"),
        "trainer.entropy_coef": (0.001, f"{S003} 270"),
        "trainer.kl_coef": (0.0, f"{S003} 269"),
        "buffer.name": ("popo", f"{S003} 269"),
        "loss.name": ("grpo", f"{S003} 269"),
    },
    "seed004-frontier": {
        "task.dataset": ("asingh15/countdown_tasks_3to4", f"{S004} 131"),
        "trainer.steps": (80, f"{S004} 135"),
        "trainer.groups_per_step": (64, f"{S004} 135"),
        "trainer.group_size": (8, f"{S004} 135"),
        "trainer.learning_rate": (1e-5, f"{S004} 135"),
        "trainer.kl_coef": (1e-3, f"{S004} 135"),
        "trainer.entropy_coef": (1e-3, f"{S004} 135"),
        "trainer.weight_decay": (1e-4, f"{S004} 135"),
        "trainer.rollout.temperature": (1.0, f"{S004} 135"),
        "trainer.rollout.top_p": (1.0, f"{S004} 135"),
        "trainer.rollout.top_k": (None, f"{S004} 135"),  # -1: off
        "curriculum.name": ("frontier", f"{S004} 90"),
        "curriculum.fraction": (0.10, f"{S004} 135"),
        "loss.name": ("rloo", f"{S004} 133"),
        "evaluation.samples_per_prompt": (128, f"{S004} 137"),
        "evaluation.ks": ([1, 16, 128], f"{S004} 137"),
        "evaluation.estimator": ("first_k", f"{S004} 137"),
        "evaluation.repeats": (1, f"{S004} 137"),
    },
    # The newer reuse methods (docs/papers.md#newer-reuse-methods): RLEP's report by section, M2PO's authors' script.
    "rlep": {
        "policy.name_or_path": ("Qwen/Qwen2.5-Math-7B", f"{RLEP} 4.1"),
        "policy.max_new_tokens": (3072, f"{RLEP} 4.1"),
        "trainer.groups_per_step": (512, f"{RLEP} 4.1"),
        "trainer.group_size": (16, f"{RLEP} 4.2"),
        "buffer.name": ("rlep", f"{RLEP} 3.2"),
        "buffer.replays": (2, f"{RLEP} 4.2"),
        "buffer.min_successes": (2, f"{RLEP} 4.2"),
        "buffer.per_prompt": (64, f"{RLEP} 4.2"),
        "loss.name": ("grpo", f"{RLEP} 3.1, Eq. 3"),
        "loss.eps_low": (0.2, f"{RLEP_SCRIPT} 10"),
        "loss.eps_high": (0.28, f"{RLEP_SCRIPT} 11"),
        "trainer.learning_rate": (1e-6, f"{RLEP_SCRIPT} 73"),
        "trainer.weight_decay": (0.1, f"{RLEP_SCRIPT} 88"),
        "trainer.max_grad_norm": (1.0, f"{RLEP_SCRIPT} 80"),
        "trainer.kl_coef": (0.0, f"{RLEP_SCRIPT} 38-41"),
        "trainer.entropy_coef": (0.0, f"{RLEP_SCRIPT} 79"),
        "trainer.rollout.temperature": (1.0, f"{RLEP} 4.1"),
        "trainer.rollout.top_p": (1.0, f"{RLEP} 4.1"),
    },
    "m2po": {
        "policy.name_or_path": ("Qwen/Qwen2.5-Math-7B", f"{M2PO_SCRIPT} 36"),
        "task.preset": ("deepscaler", "M2PO's train-scripts/m2po-qwen-math-7b-s256.sh"),
        "trainer.groups_per_step": (256, f"{M2PO_SCRIPT} 30"),
        "trainer.group_size": (8, f"{M2PO_SCRIPT} 54"),
        "trainer.learning_rate": (1e-6, f"{M2PO_SCRIPT} 37"),
        "trainer.kl_coef": (0.0, "M2PO's train-scripts/m2po-qwen-math-7b-s256.sh"),
        "trainer.entropy_coef": (0.0, "M2PO's train-scripts/m2po-qwen-math-7b-s256.sh"),
        "loss.name": ("m2po", f"{M2PO_SCRIPT} 42"),
        "loss.m2_threshold": (0.04, "M2PO project page, footnote"),
        "behaviour.name": ("stale", f"{M2PO_SCRIPT} 33"),
        "behaviour.lag": (64, f"{M2PO_SCRIPT} 33"),  # 64 steps x 4 updates = 256 updates stale
    },
}

# Mini-batch sizes (prompts) are the batch over loss.updates_per_step.
MINI_BATCHES = {"seed003-deepscaler": (128, f"{S003} 270"), "seed003-countdown": (64, f"{S003} 270"),
                "rlep": (64, f"{RLEP} 4.1"), "m2po": (64, f"{M2PO_SCRIPT} 39")}

# Each study's cells (hydra.sweeper.grids): the paper's grid.
GRIDS = {
    "seed001-async": 6 + 1,       # the (W, T) splits of Tables 1 and 3 (seed 001 lines 166-170, 2461) and the no-buffer baseline
    "seed000-countdown": 1 + 9 + 12 + 1,  # rho0, L x c, rho x c (3 cells shared with L x c), the stress probe
    "seed003-deepscaler": 3,      # POPO, GRPO, DAPO (seed 003 line 69)
    "seed003-countdown": 3,
    "seed004-frontier": 6,        # frontier and vanilla RLOO, IPO, rho in {0.05, 0.12, 0.15} (004 Tables 1, 2)
    "rlep": 2,                    # RLEP and its baseline (RLEP section 4.2, Figure 4)
    "m2po": 4,                    # M2PO and GRPO at s = 256 and s = 0 (M2PO's Table 1)
}

# What a tiny variant keeps from its paper preset: every ratio and coefficient, not the sizes.
KEPT = ("trainer.kl_coef", "trainer.entropy_coef", "trainer.rollout.temperature", "trainer.rollout.top_p",
        "loss", "buffer", "clip", "behaviour", "sampling", "curriculum.fraction", "curriculum.name", "hydra.sweeper.grids",
        "runtime.workers", "runtime.trainers", "runtime.mu", "runtime.schedule")


def presets() -> list[str]:
    return sorted(path.stem for path in (CONFIG_DIR / "experiment").glob("*.yaml"))


def paper_presets() -> list[str]:
    return [name for name in presets() if not name.endswith("-tiny")]


@pytest.fixture(scope="module")
def composed():
    from hydra import compose, initialize_config_dir

    found = {}
    for name in presets():
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            found[name] = compose("config", overrides=[f"+experiment={name}"], return_hydra_config=True)
    return found


def test_every_paper_preset_has_its_table_and_a_tiny_variant():
    assert set(PAPERS) == set(paper_presets())
    assert {f"{name}-tiny" for name in paper_presets()} == {name for name in presets() if name.endswith("-tiny")}


@pytest.mark.parametrize("preset", sorted(PAPERS))
def test_a_preset_sets_every_value_its_paper_states(composed, preset):
    cfg = composed[preset]
    wrong = {key: (_plain(OmegaConf.select(cfg, key)), value, where) for key, (value, where) in PAPERS[preset].items()
             if not _matches(_plain(OmegaConf.select(cfg, key)), value)}
    assert not wrong, f"{preset}: key -> (composed, the paper's, where): {wrong}"
    if preset in MINI_BATCHES:
        mini, where = MINI_BATCHES[preset]
        assert cfg.trainer.groups_per_step / cfg.loss.updates_per_step == mini, where


def _kept(cfg, key: str):
    """A setting a tiny variant keeps, at its own K: a FIFO's or age buffer's N counts rollouts, so the groups it
    holds; a store the synchronous step keeps nothing in (buffer=none) reads no N."""
    from src.buffer.store import ReplayStore
    from src.variant import described

    value = _plain(OmegaConf.select(cfg, key))
    if key != "buffer":
        return value
    store = described(cfg.buffer, ReplayStore)
    if store.fresh_only(cfg.buffer) and described(cfg.runtime).step_replays:
        return {name: setting for name, setting in value.items() if name != "capacity"}
    if store.capacity_counted_groups:
        return {**value, "capacity": value["capacity"] // cfg.trainer.group_size}
    return value


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _matches(got, paper) -> bool:
    if isinstance(paper, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return got == pytest.approx(paper, rel=1e-12)
    return got == paper and type(got) is type(paper)


@pytest.mark.parametrize("preset", sorted(GRIDS))
def test_a_study_preset_carries_its_papers_grid(composed, preset):
    cells = 0
    for grid in composed[preset].hydra.sweeper.grids:
        size = 1
        for value in grid.values():
            size *= len(value.split(",")) if isinstance(value, str) else 1
        cells += size
    assert cells == GRIDS[preset]


@pytest.mark.parametrize("preset", [name for name in presets() if name.endswith("-tiny")])
def test_a_tiny_variant_keeps_its_papers_ratios_on_the_cpu(composed, preset):
    tiny, paper = composed[preset], composed[preset.removesuffix("-tiny")]
    assert tiny.hardware.device == "cpu" and tiny.policy.name_or_path.startswith("checkpoints/tiny")
    changed = [key for key in KEPT if _kept(tiny, key) != _kept(paper, key)]
    assert not changed, f"{preset} changes {changed} from its paper's preset"


@pytest.mark.parametrize("preset", presets())
def test_every_preset_passes_validation(composed, preset):
    # A paper-scale preset asks for GPUs this machine may not have: its device is not checked here.
    cfg = composed[preset].copy()
    OmegaConf.set_struct(cfg, False)
    cfg.pop("hydra")
    validate(cfg, check_device=preset.endswith("-tiny"))


# One preset per code path a step takes (the async pipeline, math with POPO, the frontier curriculum), to keep the
# suite short; the sync Countdown presets (seed000, seed002, seed003-countdown) take the demo's path and are
# validated above. Each tiny preset ran a step by hand: python -m src.run +experiment=NAME trainer.steps=1
STEPPED = ("seed001-async-tiny", "seed003-deepscaler-tiny", "seed004-frontier-tiny")


@pytest.mark.slow
@pytest.mark.parametrize("preset", STEPPED)
def test_a_tiny_preset_runs_a_step(tmp_path, preset):
    store = f"sqlite:///{tmp_path}/mlruns.db"
    # 10 groups: the fewest at which seed 004's replay fraction of 0.10 replaces a prompt (round(0.1 B) >= 1).
    command = [sys.executable, "-m", "src.run", f"+experiment={preset}", "trainer.steps=1",
               "trainer.groups_per_step=10", "evaluation.at_start=false", "evaluation.prompts=2",
               "evaluation.samples_per_prompt=2", "evaluation.ks=[1]", f"tracking.uri={store}",
               f"tracking.artifact_location={tmp_path}/artifacts", f"hydra.run.dir={tmp_path}/run"]
    if preset == "seed003-deepscaler-tiny":  # its mini-batch of 16 prompts does not divide 10: the count is set
        command.append("loss.updates_per_step=2")
    # The async preset's path with two of its six rollout workers (its two trainers kept): each worker is a Ray
    # actor that imports torch and transformers, and the step took 76 CPU-seconds with six, 38 with two.
    if preset == "seed001-async-tiny":
        command.append("runtime.workers=2")
    result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr  # the run's summary goes to stderr when it is not a terminal
    assert re.search(r"fresh verifier evaluations: \d+ .*gradient steps: [1-9]", out), out[-2000:]


def test_seed001_study_is_table_1s_splits_with_63_rollouts_at_t_7(composed):
    # seed 001 lines 166-170 and 2461 (W + T = 8), lines 2287-2288 (60 rollouts, 63 when T = 7).
    cells = {(int(grid["runtime.workers"]), int(grid["runtime.trainers"])): grid
             for grid in composed["seed001-async"].hydra.sweeper.grids if "buffer" not in grid}
    assert sorted(cells, reverse=True) == [(7, 1), (6, 2), (5, 3), (4, 4), (2, 6), (1, 7)]
    assert [cell.get("buffer.batch_rollouts") for _, cell in sorted(cells.items())] == [63, None, None, None, None, None]


def test_the_async_study_trains_seed_001s_loss_without_kl_or_entropy():
    # make sweep-async is seed 001 section 3.2 at laptop scale: its loss is the paper's (D.2, lines 2292-2332).
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["+sweep=async"])
    assert (cfg.loss.name, cfg.loss.eps_low, cfg.loss.eps_high) == ("grpo-coupled", 0.2, 0.2)
    assert cfg.trainer.kl_coef == 0.0 and cfg.trainer.entropy_coef == 0.0


# The words: `--cfg job` of each paper preset shows the settings the paper states, as a user reads them.
CFG_JOB_SHOWS = {
    "seed001-async": ("name: grpo-coupled", "eps_low: 0.2", "eps_high: 0.2", "kl_coef: 0.0", "entropy_coef: 0.0",
                      "group_size: 16", "batch_rollouts: 60"),
    "seed003-deepscaler": ("max_new_tokens: 8192", "entropy_coef: 0.0", "groups_per_step: 256",
                           "updates_per_step: ${mini_batches:${trainer.groups_per_step},128}"),
}


@pytest.mark.parametrize("preset", sorted(CFG_JOB_SHOWS))
def test_cfg_job_shows_the_papers_settings(preset):
    result = subprocess.run([sys.executable, "-m", "src.run", f"+experiment={preset}", "--cfg", "job"],
                            cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    missing = [line for line in CFG_JOB_SHOWS[preset] if line not in result.stdout]
    assert not missing, f"{preset}: --cfg job lacks {missing}"


def test_a_batch_that_is_no_whole_number_of_mini_batches_is_one_line():
    # The preset is a study (a sweep of cells): its plan refuses the first cell, in one line naming it.
    result = subprocess.run([sys.executable, "-m", "src.run", "-m", "+experiment=seed003-deepscaler-tiny",
                             "trainer.groups_per_step=20", "hydra.sweeper.dry_run=true"], cwd=PROJECT_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: cell buffer=popo +experiment=seed003-deepscaler-tiny trainer.groups_per_step=20")
    assert line.endswith(
        ": loss.updates_per_step=${mini_batches:20,16}: trainer.groups_per_step=20 is not a whole number of "
        "mini-batches of 16 prompts; set trainer.groups_per_step to a multiple of 16 or loss.updates_per_step to "
        "a number")
