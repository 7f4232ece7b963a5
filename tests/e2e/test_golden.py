"""Golden numbers (torchtune style): three training steps of a few cells pinned to hard-coded values.

They must never move unless the method itself changes on purpose: a flipped sign of the entropy term,
a different KL normalisation, another advantage or weight rule, a changed draw or budget count all
show here (`test_a_changed_method_misses_the_golden_numbers` proves the comparison catches them).

Why float64 and a subprocess per CPU code path: in float32 the same step differs by up to ~3e-5
relative between PyTorch's CPU kernels (ATEN_CPU_CAPABILITY default, avx2, avx512 sum in different
orders), so numbers pinned on one machine failed on another. The cells therefore run with
`hardware.dtype=float64` (weights and every tensor of the step), where the code paths agree to ~1e-10,
and the numbers were re-pinned once from that run. ATEN_CPU_CAPABILITY is read when torch loads, so
each code path this CPU supports gets its own process; the tolerance is unchanged. On one thread, so
reductions happen in the same order. Re-pin (only for a deliberate change of the method) with
`python -m tests.e2e.test_golden --print`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from src.settings import RunSettings
from src.paths import PROJECT_ROOT
# Metrics pinned per step; rewards, weights and budgets are exact, losses to 1e-5 relative.
PINNED = ("train/loss", "train/policy_loss", "train/kl", "train/entropy", "train/reward",
          "weights/raw_mean", "weights/clipped_mean", "budget/fresh_evaluations", "budget/gradient_steps",
          "batch/fresh_groups", "batch/replay_groups")

CELLS = {
    "fresh-only": [],
    "age1": ["buffer=age1"],
    "age2-rho2-c1": ["buffer=age2", "buffer.ratio=2", "clip=tight"],
    "fifo-positive-bias": ["buffer=fifo", "buffer.positive_bias=0.5", "buffer.capacity=24"],  # 6 groups of K = 4
    "fifo-R2-at-least-once": ["buffer=fifo", "buffer.extra_updates=1", "buffer.mode=at_least_once"],
    # The golden settings keep a KL term (kl_coef 0.05) to exercise it, which POPO and DAPO drop: these cells
    # ask for the mechanism alone (mechanism_only) on the loss they pin, so their numbers stay.
    "grpo-popo": ["loss=grpo", "buffer=popo", "buffer.mechanism_only=true"],
    "popo-ineff": ["buffer=popo", "buffer.variant=popo-ineff", "loss=rloo", "buffer.mechanism_only=true"],
    "stale": ["behaviour=stale", "behaviour.lag=1"],
    "diverse-token-is": ["behaviour=diverse", "behaviour.is_level=token"],
    "dapo": ["sampling=dynamic", "loss=rloo", "sampling.mechanism_only=true"],
    "frontier": ["curriculum=frontier", "curriculum.min_memory=2", "curriculum.fraction=0.5"],
    "ipo": ["loss=ipo"],
}

# Pinned from `python -m tests.e2e.test_golden --print` (float64; equal on every CPU code path to ~1e-10).
GOLDEN: dict[str, list[dict[str, float]]] = {
    'fresh-only': [
        {'train/loss': -0.8136656776902098, 'train/policy_loss': -0.8078253145663081, 'train/kl': 0.0, 'train/entropy': 0.5840363123901693, 'train/reward': 0.1375, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': -0.07487272777255857, 'train/policy_loss': -0.09025201475369068, 'train/kl': 0.45394806058984194, 'train/entropy': 0.7318116048359975, 'train/reward': 0.05, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 2, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': -0.01724592226725491, 'train/policy_loss': -0.051167049328855296, 'train/kl': 0.8312631459423816, 'train/entropy': 0.764203023551869, 'train/reward': 0.0875, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 48, 'budget/gradient_steps': 3, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
    ],
    'age1': [
        {'train/loss': -0.8136656776902098, 'train/policy_loss': -0.8078253145663081, 'train/kl': 0.0, 'train/entropy': 0.5840363123901693, 'train/reward': 0.1375, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': -0.07232250378880259, 'train/policy_loss': -0.1611579899587241, 'train/kl': 1.9165309800276624, 'train/entropy': 0.6991062831461634, 'train/reward': 0.08125000000000002, 'weights/raw_mean': 0.5061199559670722, 'weights/clipped_mean': 0.5061199559670722, 'budget/fresh_evaluations': 24, 'budget/gradient_steps': 2, 'batch/fresh_groups': 2, 'batch/replay_groups': 2.0},
        {'train/loss': 0.49195413948940614, 'train/policy_loss': 0.24433572600670317, 'train/kl': 5.1227426402071226, 'train/entropy': 0.8518718527653178, 'train/reward': 0.05625000000000001, 'weights/raw_mean': 0.8210736603271753, 'weights/clipped_mean': 0.8210736603271753, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 3, 'batch/fresh_groups': 2, 'batch/replay_groups': 2.0},
    ],
    'age2-rho2-c1': [
        {'train/loss': -0.8136656776902098, 'train/policy_loss': -0.8078253145663081, 'train/kl': 0.0, 'train/entropy': 0.5840363123901693, 'train/reward': 0.1375, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': 0.7986255666745458, 'train/policy_loss': -0.1101192642944793, 'train/kl': 18.31621771200555, 'train/entropy': 0.706605463125258, 'train/reward': 0.1375, 'weights/raw_mean': 0.2561203642835117, 'weights/clipped_mean': 0.2561203642835117, 'budget/fresh_evaluations': 20, 'budget/gradient_steps': 2, 'batch/fresh_groups': 1, 'batch/replay_groups': 3.0},
        {'train/loss': 0.5418685233145895, 'train/policy_loss': 0.11115948459456707, 'train/kl': 8.77854542079378, 'train/entropy': 0.8218232319666658, 'train/reward': 0.06875, 'weights/raw_mean': 0.43661697916977726, 'weights/clipped_mean': 0.3359068386744817, 'budget/fresh_evaluations': 24, 'budget/gradient_steps': 3, 'batch/fresh_groups': 1, 'batch/replay_groups': 3.0},
    ],
    'fifo-positive-bias': [
        {'train/loss': -0.8136656776902098, 'train/policy_loss': -0.8078253145663081, 'train/kl': 0.0, 'train/entropy': 0.5840363123901693, 'train/reward': 0.1375, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': -0.06273642788979952, 'train/policy_loss': -0.16113418270274157, 'train/kl': 2.1013034789562615, 'train/entropy': 0.6667419134871068, 'train/reward': 0.06875, 'weights/raw_mean': 0.5005410888941022, 'weights/clipped_mean': 0.5005410888941022, 'budget/fresh_evaluations': 24, 'budget/gradient_steps': 2, 'batch/fresh_groups': 2, 'batch/replay_groups': 2.0},
        {'train/loss': 0.357665640034492, 'train/policy_loss': -0.023496526729413564, 'train/kl': 7.7944973925248835, 'train/entropy': 0.8562702862338651, 'train/reward': 0.0375, 'weights/raw_mean': 0.5580984973008427, 'weights/clipped_mean': 0.5580984973008427, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 3, 'batch/fresh_groups': 2, 'batch/replay_groups': 2.0},
    ],
    'fifo-R2-at-least-once': [
        {'train/loss': -0.8136656776902098, 'train/policy_loss': -0.8078253145663081, 'train/kl': 0.0, 'train/entropy': 0.5840363123901693, 'train/reward': 0.1375, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': -0.07232250378880259, 'train/policy_loss': -0.1611579899587241, 'train/kl': 1.9165309800276624, 'train/entropy': 0.6991062831461634, 'train/reward': 0.08125000000000002, 'weights/raw_mean': 0.5061199559670722, 'weights/clipped_mean': 0.5061199559670722, 'budget/fresh_evaluations': 24, 'budget/gradient_steps': 3, 'batch/fresh_groups': 2, 'batch/replay_groups': 2.0},
        {'train/loss': 0.04413891395917233, 'train/policy_loss': -0.09443597531363729, 'train/kl': 2.954528490414834, 'train/entropy': 0.9151535247932094, 'train/reward': 0.05625, 'weights/raw_mean': 0.511539500540749, 'weights/clipped_mean': 0.511539500540749, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 5, 'batch/fresh_groups': 2, 'batch/replay_groups': 2.0},
    ],
    'grpo-popo': [
        {'train/loss': 0.5150686786200859, 'train/policy_loss': 0.14611947766916566, 'train/kl': 7.538667710949962, 'train/entropy': 0.7984184596577945, 'train/reward': 0.17500000000000004, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 4, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': 0.5024079498718683, 'train/policy_loss': 0.04674548368769174, 'train/kl': 9.36762463490022, 'train/entropy': 1.271876556083449, 'train/reward': 0.06875, 'weights/raw_mean': 3.552267855031391, 'weights/clipped_mean': 0.9039715227415793, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 8, 'batch/fresh_groups': 4, 'batch/replay_groups': 1.0},
        {'train/loss': 0.19096870864562973, 'train/policy_loss': -0.014070333669939525, 'train/kl': 4.399002164983097, 'train/entropy': 1.4911065933585599, 'train/reward': 0.06875, 'weights/raw_mean': 3.390825192365669, 'weights/clipped_mean': 0.7103186370979676, 'budget/fresh_evaluations': 48, 'budget/gradient_steps': 12, 'batch/fresh_groups': 4, 'batch/replay_groups': 4.0},
    ],
    'popo-ineff': [
        {'train/loss': -1.6217396273408402, 'train/policy_loss': -1.6156506291326158, 'train/kl': 0.0, 'train/entropy': 0.6088998208224492, 'train/reward': 0.17500000000000004, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': -0.0754268075583796, 'train/policy_loss': -0.0908214686112879, 'train/kl': 0.45423779376738826, 'train/entropy': 0.7317228635461143, 'train/reward': 0.05, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 2, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': 0.11662078415595209, 'train/policy_loss': 0.07023602066564522, 'train/kl': 1.0789675432957302, 'train/entropy': 0.756361367447965, 'train/reward': 0.0625, 'weights/raw_mean': 1.0813268253988657, 'weights/clipped_mean': 1.0813268253988657, 'budget/fresh_evaluations': 48, 'budget/gradient_steps': 3, 'batch/fresh_groups': 4, 'batch/replay_groups': 1.0},
    ],
    'stale': [
        {'train/loss': -0.8136656776902098, 'train/policy_loss': -0.8078253145663081, 'train/kl': 0.0, 'train/entropy': 0.5840363123901693, 'train/reward': 0.1375, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': 0.32205990337670953, 'train/policy_loss': 0.000846992644223175, 'train/kl': 6.5622908192135805, 'train/entropy': 0.6901630228192671, 'train/reward': 0.07500000000000001, 'weights/raw_mean': 0.0015607276039921432, 'weights/clipped_mean': 0.0015607276039921432, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 2, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': 0.16761257410432623, 'train/policy_loss': 0.09066709733598638, 'train/kl': 1.698615865941013, 'train/entropy': 0.79853165287108, 'train/reward': 0.0625, 'weights/raw_mean': 0.06078451541666679, 'weights/clipped_mean': 0.06078451541666679, 'budget/fresh_evaluations': 48, 'budget/gradient_steps': 3, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
    ],
    'diverse-token-is': [
        {'train/loss': -0.23303524426847094, 'train/policy_loss': -0.2265170836574345, 'train/kl': 0.0, 'train/entropy': 0.6518160611036422, 'train/reward': 0.056249999999999994, 'weights/raw_mean': 1.0089971471635382, 'weights/clipped_mean': 1.0089971471635382, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': -0.0480347413881835, 'train/policy_loss': -0.06492957674730683, 'train/kl': 0.46407985071917446, 'train/entropy': 0.6309157176835392, 'train/reward': 0.04375, 'weights/raw_mean': 0.9986598934404991, 'weights/clipped_mean': 0.9986598934404991, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 2, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': -0.03336942299112555, 'train/policy_loss': -0.055317436575759604, 'train/kl': 0.5890361482140574, 'train/entropy': 0.7503793826068809, 'train/reward': 0.037500000000000006, 'weights/raw_mean': 1.0118300995056546, 'weights/clipped_mean': 1.0118300995056546, 'budget/fresh_evaluations': 48, 'budget/gradient_steps': 3, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
    ],
    'dapo': [
        {'train/loss': -1.5117519541725342, 'train/policy_loss': -1.5055654733893649, 'train/kl': 0.0, 'train/entropy': 0.6186480783169322, 'train/reward': 0.125, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 24, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': -0.29532772997898504, 'train/policy_loss': -0.3029366298147101, 'train/kl': 0.2621673098210588, 'train/entropy': 0.549946565532792, 'train/reward': 0.075, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 60, 'budget/gradient_steps': 2, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': -0.010912668815081149, 'train/policy_loss': -0.02911899326151774, 'train/kl': 0.5015565244579323, 'train/entropy': 0.6871501776460028, 'train/reward': 0.05, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 92, 'budget/gradient_steps': 3, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
    ],
    'frontier': [
        {'train/loss': -1.529288845597843, 'train/policy_loss': -1.5231145506407386, 'train/kl': 0.0, 'train/entropy': 0.6174294957104471, 'train/reward': 0.25625000000000003, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': -0.263525960027086, 'train/policy_loss': -0.2682463362991685, 'train/kl': 0.2080842376038195, 'train/entropy': 0.5683835608108485, 'train/reward': 0.07500000000000001, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 2, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': -0.16143834516029382, 'train/policy_loss': -0.18815485696351003, 'train/kl': 0.6872134025047995, 'train/entropy': 0.7644158322023755, 'train/reward': 0.06875, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 48, 'budget/gradient_steps': 3, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
    ],
    'ipo': [
        {'train/loss': 25.0, 'train/policy_loss': 25.0, 'train/kl': 0.0, 'train/entropy': 0.5840363123901693, 'train/reward': 0.1375, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': 96.08678826033946, 'train/policy_loss': 96.08678826033946, 'train/kl': 0.5225739804310208, 'train/entropy': 0.6299565499748274, 'train/reward': 0.08750000000000001, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 2, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': 146.90061008746991, 'train/policy_loss': 146.90061008746991, 'train/kl': 0.7447171293965844, 'train/entropy': 0.8241396550561243, 'train/reward': 0.06875, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 48, 'budget/gradient_steps': 3, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
    ],
}


# Changes to the method that the golden comparison must catch: each one misses the pins of fresh-only.
MUTANTS = {
    "entropy sign flipped": ["trainer.entropy_coef=-0.01"],
    "KL normalised over half the tokens": ["trainer.kl_coef=0.1"],
    "another KL estimator": ["trainer.kl_estimator=k2"],
}

GOLDEN_SETTINGS = ("trainer.groups_per_step=4", "trainer.group_size=4", "policy.max_new_tokens=48",
                   "trainer.micro_batch_size=6", "trainer.learning_rate=1e-3", "trainer.kl_coef=0.05",
                   "trainer.entropy_coef=0.01", "hardware.threads=1")
# ATen's x86 code paths, lowest first; a CPU runs every one up to the best it supports.
CAPABILITIES = ("default", "avx2", "avx512")


def run_steps(cfg, train_set, steps: int) -> list[dict[str, float]]:
    """`steps` training steps of `cfg` with the components src.build builds; the metrics of each step."""
    from src.build import build_components
    from src.batch import TrainState
    from src.train import train_step

    parts = build_components(RunSettings(cfg), train_set)
    state = TrainState()
    return [train_step(parts, state) for _ in range(steps)]


def golden_config(compose_config, overrides):
    """The golden cells' small settings plus `overrides`, composed from the real config."""
    return compose_config(*GOLDEN_SETTINGS, *overrides)


def mismatches(expected: list[dict], actual: list[dict]) -> list[str]:
    """Every pinned metric of `actual` that is not `expected` to 1e-5 relative (rewards and counts: exactly)."""
    if len(expected) != len(actual):
        return [f"{len(actual)} steps, {len(expected)} pinned"]
    out = []
    for step, (want, got) in enumerate(zip(expected, actual)):
        if want.keys() != got.keys():
            out.append(f"step {step}: metrics {sorted(got)}")
            continue
        out += [f"step {step} {key}: {got[key]!r}, pinned {value!r}" for key, value in want.items()
                if got[key] != pytest.approx(value, rel=1e-5, abs=1e-7)]
    return out


def supported_capabilities() -> list[str]:
    """The ATEN_CPU_CAPABILITY values this CPU can run: every one up to the best torch picks by itself."""
    import torch

    best = torch.backends.cpu.get_cpu_capability().lower()
    return list(CAPABILITIES[: CAPABILITIES.index(best) + 1]) if best in CAPABILITIES else [best]


def compute_in_subprocess(capability: str, tmp_path, mutants: bool) -> dict:
    """Every cell (and mutant, if asked), computed by `python -m tests.e2e.test_golden` under
    ATEN_CPU_CAPABILITY=capability."""
    out = tmp_path / f"golden-{capability}.json"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run([sys.executable, "-m", "tests.e2e.test_golden", "--out", str(out),
                           *(["--mutants"] if mutants else [])], cwd=PROJECT_ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


# The mutants test the comparison, not a code path: they run on the best path alone (no reason to pay for them
# three times), where this CPU's own runs happen.
BEST = supported_capabilities()[-1]


@pytest.fixture(scope="module", params=supported_capabilities())
def computed(request, tmp_path_factory):
    """{"capability": ..., "cells": {cell: steps}, "mutants": {name: steps}} for one CPU code path; the mutants
    on the best path only (empty elsewhere)."""
    return compute_in_subprocess(request.param, tmp_path_factory.mktemp("golden"), mutants=request.param == BEST)


def test_three_steps_reproduce_the_golden_numbers_on_this_cpu_code_path(request, computed):
    requested = request.node.callspec.params["computed"]
    assert computed["capability"] == requested, f"torch ran {computed['capability']}, not {requested}"
    failures = {cell: mismatches(GOLDEN[cell], computed["cells"][cell]) for cell in CELLS}
    failures = {cell: found for cell, found in failures.items() if found}
    assert not failures, f"under ATEN_CPU_CAPABILITY={requested}: {json.dumps(failures, indent=1)}"


@pytest.mark.parametrize("computed", [BEST], indirect=True)  # the best path's subprocess, shared with its cells
def test_a_changed_method_misses_the_golden_numbers(computed):
    assert sorted(computed["mutants"]) == sorted(MUTANTS), computed["capability"]
    for name, steps in computed["mutants"].items():
        assert mismatches(GOLDEN["fresh-only"], steps), f"{name}: still matches the golden numbers"


def compute_all(mutants: bool = True) -> dict:
    """Every golden cell (and mutant) in float64 on one thread (the subprocess side of the tests)."""
    import torch
    from hydra import compose, initialize_config_dir

    import src.command.config  # noqa: F401  (registers the ${root:} resolver)
    from src.paths import CONFIG_DIR
    from src.task import countdown

    def steps_of(overrides):
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[*GOLDEN_SETTINGS, "hardware.dtype=float64", *overrides])
        history = run_steps(cfg, countdown.generate_instances(64, seed=1), steps=3)
        return [{key: step[key] for key in PINNED if key in step} for step in history]

    torch.set_num_threads(1)
    return {"capability": torch.backends.cpu.get_cpu_capability().lower(),
            "cells": {cell: steps_of(overrides) for cell, overrides in CELLS.items()},
            "mutants": {name: steps_of(CELLS["fresh-only"] + overrides) for name, overrides in MUTANTS.items()
                        if mutants}}


def main() -> None:
    parser = argparse.ArgumentParser(description="Compute the golden cells (float64, one thread).")
    parser.add_argument("--out", help="write the cells as JSON here")
    parser.add_argument("--print", action="store_true", help="print a GOLDEN dict to paste when re-pinning")
    parser.add_argument("--mutants", action="store_true", help="also the changed methods the pins must reject")
    args = parser.parse_args()
    result = compute_all(args.mutants)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle)
    if args.print:
        print("GOLDEN: dict[str, list[dict[str, float]]] = {")
        for cell, steps in result["cells"].items():
            print(f"    {cell!r}: [")
            for step in steps:
                print(f"        {step!r},")
            print("    ],")
        print("}")


if __name__ == "__main__":
    main()
