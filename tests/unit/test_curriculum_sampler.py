"""Curriculum prompt samplers (SPEC 9, seed 004 sec. 3.1, app. B.3): config, fall-back, retrieval, resume."""

import json
import warnings

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import src.command.config  # noqa: F401  (registers the ${root:} resolver)
from src.curriculum.sampler import (
    KEYS,
    NAMES,
    CurriculumSampler,
    build_prompt_sampler,
    check_curriculum,
)
from src.paths import CONFIG_DIR
from src.task.countdown import generate_instances, train_and_heldout
from src.curriculum.uniform import PromptSampler
from tests.unit.test_frontier import TASK, I  # noqa: E402 - the task and short Instance constructor the fixtures share


def frontier_cfg(**overrides):
    """The conf/curriculum/frontier.yaml defaults as a plain dict, with overrides."""
    cfg = dict(name="frontier", fraction=0.10, capacity=256, min_memory=8, pool_factor=4,
               goldilocks_band=0.25, max_numbers=4)
    cfg.update(overrides)
    return cfg


def rewards(correct, k=8, wrong=0.0):
    """A group of K rewards with `correct` fully correct (1.0) responses, the rest `wrong`."""
    return [1.0] * correct + [wrong] * (k - correct)


# Hand-built bank: two remembered prompts A and B, each with one near twin (A2: 40 -> 42,
# B2: 9 -> 11, same parity, target and count), and fillers of other shapes. Cosines
# (prompt_embedding): A.A2 = B.B2 = 0.9998, every filler <= 0.90 to A or B.
A, A2 = I((10, 20, 30, 40), 50), I((10, 20, 30, 42), 50)
B, B2 = I((5, 7, 9), 80), I((5, 7, 11), 80)
FILLERS = [I((90, 95, 97, 99), 3), I((2, 50, 99), 7), I((60, 3, 3, 8), 1), I((33, 66, 99), 11),
           I((70, 71, 72, 73), 99), I((4, 6, 8), 2), I((25, 25, 50, 50), 25), I((44, 88, 12), 64)]
BANK = [A, A2, B, B2, *FILLERS]


# --------------------------------------------------------------------------- none


def test_none_is_the_plain_prompt_sampler_with_the_same_draws():
    instances = generate_instances(50, seed=1)
    sampler = build_prompt_sampler({"name": "none"}, instances, seed=7)
    twin = PromptSampler(instances, seed=7)
    assert type(sampler) is PromptSampler
    for count in (5, 8, 60):  # 60 > 50: the with-replacement branch too
        drawn = sampler.sample(count)
        sampler.observe(drawn, [rewards(3)] * count, step=0)  # a no-op: does not touch the stream
        assert drawn == twin.sample(count)
    assert sampler.metrics() == {}


# --------------------------------------------------------------------------- fall-back


def test_below_min_memory_the_replaced_slots_are_uniform():
    sampler = CurriculumSampler(BANK, seed=0, task=TASK, fraction=0.5, min_memory=2, pool_factor=1)
    twin = PromptSampler(BANK, seed=0)
    batch = sampler.sample(4)
    # round(0.5 * 4) = 2 slots replaced; the first 2 are the inner sampler's own draws.
    assert batch[:2] == twin.sample(4)[:2]
    assert len({x.key for x in batch}) == 4  # fall-back picks avoid the batch's keys
    m = sampler.metrics()
    assert (m["curriculum/requested"], m["curriculum/retrieved"], m["curriculum/uniform_fallback"]) == (2, 0, 2)
    assert m["curriculum/memory_size"] == 0 and "curriculum/retrieval_score_mean" not in m

    # One frontier prompt in memory is still below min_memory = 2: still uniform.
    sampler.observe([A], [rewards(3)], step=0)
    sampler.sample(4)
    m = sampler.metrics()
    assert (m["curriculum/memory_size"], m["curriculum/retrieved"], m["curriculum/uniform_fallback"]) == (1, 0, 2)


# --------------------------------------------------------------------------- retrieval


def test_frontier_retrieves_the_nearest_neighbours_of_memory():
    sampler = CurriculumSampler(BANK, seed=0, task=TASK, fraction=0.5, min_memory=2, pool_factor=1)
    sampler.observe([A, B], [rewards(3), rewards(3)], step=0)  # 3 of 8: frontier, u = 4 * 3/8 * 5/8 = 0.9375
    m = sampler.metrics()
    assert (m["curriculum/admitted"], m["curriculum/admitted_fraction"], m["curriculum/memory_size"]) == (2, 1.0, 2)

    uniform = PromptSampler(BANK, seed=0).sample(4)
    assert not {A2, B2} & set(uniform)  # precondition of this seed: neither twin is filtered out by the batch
    batch = sampler.sample(4)
    assert batch[:2] == uniform[:2]
    # pool_factor = 1: the deterministic top-2 by c_m = max_j cos * u_j, i.e. the near twins A2 and B2
    # (cos 0.9998 each); never A or B themselves (they are keys in memory).
    assert set(batch[2:]) == {A2, B2}
    m = sampler.metrics()
    assert (m["curriculum/requested"], m["curriculum/retrieved"], m["curriculum/uniform_fallback"]) == (2, 2, 0)
    # c_m = 0.9375 * 0.9998 = 0.9373 for both.
    assert m["curriculum/retrieval_score_mean"] == pytest.approx(0.9375 * 0.9998, abs=2e-4)


def test_retrieval_never_repeats_memory_batch_or_earlier_picks():
    instances = generate_instances(400, seed=5)
    sampler = CurriculumSampler(instances, seed=1, task=TASK, fraction=0.25, min_memory=4, capacity=64, pool_factor=4)
    for step in range(12):
        memory_keys = sampler.memory.keys()
        batch = sampler.sample(16)
        n, m = 4, sampler.metrics()
        retrieved = batch[16 - n : 16 - n + int(m["curriculum/retrieved"])]
        assert len({x.key for x in batch[16 - n :]}) == n  # no pick twice
        assert not {x.key for x in batch[16 - n :]} & ({x.key for x in batch[: 16 - n]} | memory_keys)
        if step >= 1:
            assert m["curriculum/retrieved"] == n  # memory filled at step 0 (16 prompts, s cycles 0..8)
            assert not {x.key for x in retrieved} & memory_keys
        sampler.observe(batch, [rewards((x.target + i) % 9) for i, x in enumerate(batch)], step)


def test_several_sample_rounds_in_one_step_add_up_and_do_not_repeat():
    sampler = CurriculumSampler(BANK, seed=0, task=TASK, fraction=0.5, min_memory=2, pool_factor=1)
    sampler.observe([A, B], [rewards(3), rewards(4)], step=0)
    first = sampler.sample(2)  # round(0.5 * 2) = 1 retrieved
    second = sampler.sample(2)  # same step (no observe in between): another 1, not the first's prompt
    m = sampler.metrics()
    assert (m["curriculum/requested"], m["curriculum/retrieved"]) == (2, 2)
    assert {first[1], second[1]} == {A2, B2}  # the top two, one per round
    sampler.observe(first + second, [rewards(0)] * 4, step=1)
    sampler.sample(2)  # first sample after observe: a new step, counters restart
    assert sampler.metrics()["curriculum/requested"] == 1


def test_rounds_observed_one_by_one_add_up_per_step():
    # The trainer's dynamic sampling observes after every round; metrics still cover the whole step.
    sampler = CurriculumSampler(BANK, seed=0, task=TASK, fraction=0.5, min_memory=2, pool_factor=1)
    sampler.observe([A, B], [rewards(3), rewards(3)], step=0)
    twin = PromptSampler(BANK, seed=0)
    uniform = twin.sample(2) + twin.sample(2)
    assert not {A2, B2} & set(uniform)  # precondition of this seed
    first = sampler.sample(2)
    sampler.observe(first, [rewards(8), rewards(0)], step=1)  # nothing admitted: the pick stays out of memory
    second = sampler.sample(2)
    sampler.observe(second, [rewards(3), rewards(5)], step=1)  # both admitted
    assert {first[1], second[1]} == {A2, B2}  # round 2 does not repeat round 1's pick
    m = sampler.metrics()
    assert (m["curriculum/requested"], m["curriculum/retrieved"]) == (2, 2)
    assert (m["curriculum/admitted"], m["curriculum/admitted_fraction"]) == (2, 0.5)
    third = sampler.sample(2)
    sampler.observe(third, [rewards(0)] * 2, step=2)  # a new step: its own counts only
    m = sampler.metrics()
    assert (m["curriculum/requested"], m["curriculum/admitted"], m["curriculum/admitted_fraction"]) == (1, 0, 0.0)


def test_uniform_part_follows_the_inner_sampler_stream():
    instances = generate_instances(200, seed=2)
    sampler = CurriculumSampler(instances, seed=3, task=TASK, fraction=0.25, min_memory=1)
    twin = PromptSampler(instances, seed=3)
    for step in range(5):
        batch = sampler.sample(8)
        assert batch[:6] == twin.sample(8)[:6]  # the retrieval RNG never draws from the inner stream
        sampler.observe(batch, [rewards(4)] * 8, step)


# --------------------------------------------------------------------------- memory criteria


def test_frontier_counts_only_full_reward_as_correct():
    sampler = CurriculumSampler(BANK, seed=0, task=TASK)
    # 3 correct + 5 partial credit 0.1 -> s = 3: frontier. 8 partial credit -> s = 0: not. 8 correct: not.
    sampler.observe([A, B, A2], [rewards(3, wrong=0.1), rewards(0, wrong=0.1), rewards(8)], step=0)
    assert sampler.memory.keys() == {A.key}
    m = sampler.metrics()
    assert (m["curriculum/admitted"], m["curriculum/admitted_fraction"]) == (1, pytest.approx(1 / 3))


def test_failure_admits_only_total_failures():
    sampler = build_prompt_sampler(frontier_cfg(name="failure"), BANK, seed=0, task=TASK)
    sampler.observe([A, B, A2, B2], [rewards(0), rewards(0, wrong=0.1), rewards(1), rewards(8)], step=0)
    assert sampler.memory.keys() == {A.key, B.key}
    assert [e.priority for e in sampler.memory.entries] == [1.0, 1.0]
    assert sampler.metrics()["curriculum/admitted_fraction"] == 0.5


def test_goldilocks_admits_only_the_band_around_one_half():
    sampler = build_prompt_sampler(frontier_cfg(name="goldilocks", goldilocks_band=0.25), BANK, seed=0, task=TASK)
    # K = 8, band 0.25: p in [0.25, 0.75] <=> s in 2..6. s = 0, 1, 7, 8 are rejected.
    batch = BANK[:9]
    sampler.observe(batch, [rewards(s) for s in range(9)], step=0)
    assert sorted(e.correct for e in sampler.memory.entries) == [2, 3, 4, 5, 6]
    assert sampler.metrics()["curriculum/admitted"] == 5


def test_capacity_evictions_are_counted():
    sampler = CurriculumSampler(BANK, seed=0, task=TASK, capacity=2, min_memory=1)
    sampler.observe([A, B, A2], [rewards(3)] * 3, step=0)
    m = sampler.metrics()
    assert (m["curriculum/memory_size"], m["curriculum/dropped"]) == (2, 1)
    assert sampler.memory.keys() == {B.key, A2.key}  # the oldest (A) was dropped


# --------------------------------------------------------------------------- checkpoints


def _outcomes(batch, step):
    return [rewards((x.target * 7 + step) % 9) for x in batch]


def _run(sampler, steps, start=0):
    """`steps` steps of three sample rounds (observed together, then one more observed alone)."""
    trace = []
    for step in range(start, start + steps):
        batch = sampler.sample(12) + sampler.sample(5)
        trace.append((batch, sampler.metrics()))
        sampler.observe(batch, _outcomes(batch, step), step)
        extra = sampler.sample(3)
        sampler.observe(extra, _outcomes(extra, step), step)
        trace.append((extra, sampler.metrics()))
    return trace


@pytest.mark.parametrize("mode", ["frontier", "failure", "goldilocks"])
def test_state_dict_round_trip_continues_identically(mode):
    instances = generate_instances(300, seed=4)
    cfg = frontier_cfg(name=mode, fraction=0.25, capacity=20, min_memory=3, pool_factor=3)
    uninterrupted = build_prompt_sampler(cfg, instances, seed=11, task=TASK)
    interrupted = build_prompt_sampler(cfg, instances, seed=11, task=TASK)
    _run(uninterrupted, 3)
    _run(interrupted, 3)
    interrupted.sample(4)  # mid-step too: the state carries this step's drawn prompts and counters
    uninterrupted.sample(4)
    state = json.loads(json.dumps(interrupted.state_dict()))  # plain data (a JSON round trip loses tuples)

    restored = build_prompt_sampler(cfg, instances, seed=999, task=TASK)  # another seed: all comes from state
    restored.load_state_dict(state)
    assert restored.metrics() == uninterrupted.metrics()
    assert _run(restored, 4, start=3) == _run(uninterrupted, 4, start=3)
    assert uninterrupted.metrics()["curriculum/retrieved"] > 0  # retrieval was active, not only fall-back


def test_loading_a_mismatched_state_fails_clearly():
    instances = generate_instances(50, seed=4)
    sampler = CurriculumSampler(instances, seed=0, task=TASK)
    with pytest.raises(ValueError, match="curriculum=none"):
        sampler.load_state_dict(PromptSampler(instances, seed=0).state_dict())
    other = CurriculumSampler(instances, seed=0, task=TASK, capacity=5)
    with pytest.raises(ValueError, match="capacity"):
        other.load_state_dict(sampler.state_dict())


# --------------------------------------------------------------------------- config checks


@pytest.mark.parametrize("override,group_size,groups_per_step,expected", [
    ({"name": "bogus"}, 8, 32, ["'bogus'", "none, frontier, failure, goldilocks"]),
    ({"fraction": 1.5}, 8, 32, ["curriculum.fraction=1.5", "[0.0, 1.0]"]),
    ({"fraction": -0.1}, 8, 32, ["curriculum.fraction=-0.1"]),
    ({"fraction": 0.01}, 8, 32, ["curriculum.fraction=0.01", "B=32", "round(fraction * B) = 0"]),
    ({"fraction": 0.0}, 8, 32, ["curriculum.fraction=0.0", "curriculum=none"]),
    ({"capacity": 0}, 8, 32, ["curriculum.capacity=0"]),
    ({"capacity": 2.5}, 8, 32, ["curriculum.capacity=2.5"]),
    ({"min_memory": 0}, 8, 32, ["curriculum.min_memory=0"]),
    ({"min_memory": 300}, 8, 32, ["curriculum.min_memory=300", "curriculum.capacity=256"]),
    ({"pool_factor": 0}, 8, 32, ["curriculum.pool_factor=0"]),
    ({"goldilocks_band": 0.6}, 8, 32, ["curriculum.goldilocks_band=0.6", "[0.0, 0.5]"]),
    ({"goldilocks_band": -0.1}, 8, 32, ["curriculum.goldilocks_band=-0.1"]),
    ({"max_numbers": 0}, 8, 32, ["curriculum.max_numbers=0"]),
    ({"fracton": 0.2}, 8, 32, ["fracton"]),
    ({"name": "frontier"}, 1, 32, ["K=1"]),
    ({"name": "goldilocks", "goldilocks_band": 0.1}, 3, 32, ["goldilocks_band=0.1", "K=3"]),
])
def test_check_curriculum_names_the_bad_value(override, group_size, groups_per_step, expected):
    with pytest.raises(ValueError) as error:
        check_curriculum(frontier_cfg(**override), group_size=group_size, groups_per_step=groups_per_step)
    for text in expected:
        assert text in str(error.value)


def test_check_curriculum_names_a_missing_key():
    cfg = frontier_cfg()
    del cfg["pool_factor"]
    with pytest.raises(ValueError, match="pool_factor"):
        check_curriculum(cfg, group_size=8, groups_per_step=32)
    with pytest.raises(ValueError, match="pool_factor"):
        build_prompt_sampler(cfg, BANK, seed=0, task=TASK)


# --------------------------------------------------------------------------- hydra


def _options():
    return sorted(path.stem for path in (CONFIG_DIR / "curriculum").glob("*.yaml"))


def test_the_config_group_offers_every_name():
    assert _options() == sorted(NAMES)


@pytest.mark.parametrize("option", _options())
def test_every_option_composes_checks_and_builds(option):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"curriculum={option}", "task.train_size=300"])
    curriculum, trainer = cfg.curriculum, cfg.trainer
    assert curriculum.name == option
    assert set(curriculum) <= set(KEYS)  # every key in the YAML is one the code reads
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warn-free
        check_curriculum(curriculum, group_size=trainer.group_size, groups_per_step=trainer.groups_per_step)
        train, _ = train_and_heldout(cfg.task)
        sampler = build_prompt_sampler(curriculum, train, seed=trainer.seed, task=TASK)
    if option == "none":
        assert type(sampler) is PromptSampler
        return
    assert isinstance(sampler, CurriculumSampler) and sampler.memory.mode == option
    assert set(curriculum) == set(KEYS)
    assert OmegaConf.to_container(curriculum)["fraction"] == 0.10  # seed 004's rho
    for step in range(3):
        batch = sampler.sample(trainer.groups_per_step)
        assert len(batch) == trainer.groups_per_step
        sampler.observe(batch, [rewards(i % 9, k=8) for i in range(len(batch))], step)
    m = sampler.metrics()
    assert m["curriculum/requested"] == round(0.10 * trainer.groups_per_step)
    assert m["curriculum/memory_size"] > 0
