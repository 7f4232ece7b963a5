"""Cell ids are the key the sweeper skips finished cells by: these ids, computed before the step became
components, must survive every refactor of config or code (`src.study.sweep.CELL_ID_VERSION`)."""

from __future__ import annotations

import pytest

from src.study.sweep import cell_identity, cell_name

SURVIVING = {
    '': ('rho0', '86b76e396c281b2b'),
    'buffer=age1': ('rho1-L1-c10', '45a2bb86ab931791'),
    'buffer=age2 clip=tight': ('rho1-L2-c1', 'e9f099f585476ec0'),
    'buffer=age3 buffer.ratio=2 clip=stress': ('rho2-L3-c1000', 'fcf0aa6c6df66161'),
    'buffer=fifo': ('fifo-rho1-N4096-with_replacement-c10', '258582b864a97fc2'),
    'buffer=fifo buffer.positive_bias=0.5': ('fifo-rho1-N4096-with_replacement-pb0.5-c10', '34b75a2b126e0464'),
    'buffer=fifo buffer.extra_updates=1': ('fifo-rho1-N4096-with_replacement-R2-c10', '2ee6ecba00db6796'),
    # `buffer=popo`, `sampling=dynamic` and `behaviour=stale` now compute seed 003's and seed 002's settings
    # (no KL, loss=grpo, rho_max 10): the cells computed before are these explicit overrides.
    'buffer=popo loss=grpo trainer.kl_coef=1e-3 buffer.mechanism_only=true': ('popo-grpo', 'aca1f97e3d1ce43a'),
    'loss=grpo': ('rho0-grpo', 'b5fa66298c269181'),
    'loss=ipo': ('rho0-ipo', '5fd3a71546eab4d5'),
    'behaviour=stale behaviour.is_max=2': ('rho0-stale4', '7e0d750725cb5bdf'),
    'sampling=dynamic loss=rloo trainer.kl_coef=1e-3 sampling.mechanism_only=true': ('rho0-dapo', 'ad9800b74ff3dfc8'),
    'curriculum=frontier': ('rho0-frontier', '180dba9f64e15010'),
    'trainer=paper policy=qwen2.5-0.5b buffer=age2 clip=tight': ('rho1-L2-c1', '91395729af24b854'),
    'hardware=h100': ('rho0', '2b47660fa3274c18'),
    # Seed 001's pipeline: the queue's settings spelled as version 1 spelled them (`AsyncRuntime.identity`).
    'runtime=async': ('rho0-W2T1-lifo', '9f8750d0bdc57bd0'),
    'runtime=async buffer=fifo buffer.capacity=1024': ('rho0-W2T1-N1024', '3aaee7fcd5292e08'),
    '+experiment=seed001-async': ('rho0-grpo-coupled-W6T2-N252-math', '490685ab8e240115'),
    # The replay settings the pipeline once read from `runtime` (sharded, batch_rollouts, staleness_mode=drop):
    # set in `buffer`, each cell keeps the id it had when typed as runtime.sharded=true, runtime.batch_rollouts=B,
    # runtime.staleness=L runtime.staleness_mode=drop.
    'runtime=async buffer=fifo buffer.capacity=1536 buffer.sharded=true runtime.trainers=2':
        ('rho0-W2T2-N1536', '00e75a12027f7dc5'),
    'runtime=async buffer=fifo buffer.capacity=1024 buffer.max_age=2': ('rho0-W2T1-N1024', '7143602860f5f7f4'),
    'runtime=async buffer.max_age=1': ('rho0-W2T1-lifo', '9d79876d9fa1441a'),
    'runtime=async runtime.staleness=2': ('rho0-W2T1-lifo', 'd388e726d3cae8e6'),
    'runtime=async buffer.batch_rollouts=64': ('rho0-W2T1-lifo', '90b2092f24211ed9'),
    '+experiment=seed001-async runtime.workers=1 runtime.trainers=7 buffer.batch_rollouts=63':
        ('rho0-grpo-coupled-W1T7-N252-math', '01d77c0824eed91d'),
    '+experiment=seed001-async buffer=none buffer.capacity=252 runtime.workers=6 runtime.trainers=2':
        ('rho0-grpo-coupled-W6T2-lifo-math', 'd78eb54fa810f5f0'),
}


@pytest.mark.parametrize("overrides", SURVIVING)
def test_existing_cell_ids_survive(compose_config, overrides):
    cfg = compose_config(*overrides.split())
    assert (cell_name(cfg), cell_identity(cfg)) == SURVIVING[overrides]


@pytest.mark.parametrize("queue", [[], ["buffer=fifo", "buffer.capacity=1024"]])
def test_async_cells_that_weigh_stale_rollouts_at_other_ceilings_are_other_cells(compose_config, queue):
    """Under runtime=async eq. 2 weighs every stale rollout, LIFO's too: with loss=rloo the clip ceiling is the
    cell's (named and hashed away from the default ceiling, where version-1 ids left it out); a loss that reads
    no ceiling keeps one cell whatever the clip group says."""
    default, tight = (compose_config("runtime=async", *queue, *clip) for clip in ([], ["clip=tight"]))
    assert cell_identity(default) != cell_identity(tight) and cell_name(tight) == cell_name(default) + "-c1"
    coupled = [compose_config("runtime=async", "loss=grpo-coupled", *queue, *clip) for clip in ([], ["clip=tight"])]
    assert cell_identity(coupled[0]) == cell_identity(coupled[1]) and cell_name(coupled[0]) == cell_name(coupled[1])


def test_the_age_option_with_max_age_is_the_ageL_cell(compose_config):
    one_option = compose_config("buffer=age", "buffer.max_age=2", "clip=tight")
    assert cell_identity(one_option) == SURVIVING["buffer=age2 clip=tight"][1]
    assert cell_name(one_option) == "rho1-L2-c1"


def test_the_implementing_class_is_not_part_of_the_cell(compose_config):
    plain = compose_config("buffer=age1")
    moved = compose_config("buffer=age1", "buffer._target_=tests.outside_variants.variants.AgeCopyStore")
    assert cell_identity(moved) == cell_identity(plain)


def test_a_knob_added_later_keeps_ids_at_its_old_behaviour(compose_config):
    """trainer.kl_estimator arrived after version 1: at k3 (what every earlier cell computed) the id survives."""
    explicit = compose_config("buffer=age2", "clip=tight", "trainer.kl_estimator=k3")
    assert cell_identity(explicit) == SURVIVING["buffer=age2 clip=tight"][1]
    assert cell_identity(compose_config("buffer=age2", "clip=tight", "trainer.kl_estimator=k2")) != cell_identity(explicit)


def test_the_age_window_and_the_staleness_bound_together_are_a_cell_of_their_own(compose_config):
    """Version 1 could not set both (one `staleness_mode`); together they name a cell apart from each alone."""
    ids = {cell_identity(compose_config("runtime=async", *bounds)) for bounds in
           (("buffer.max_age=1",), ("runtime.staleness=1",), ("buffer.max_age=1", "runtime.staleness=1"))}
    assert len(ids) == 3


def test_settings_of_the_rollout_form_alone_leave_a_synchronous_cell_as_it_was(compose_config):
    """Under runtime=sync one store serves the step: sharding and B of the pipeline change nothing, name nothing."""
    plain = cell_identity(compose_config("buffer=seed001", "buffer.sharded=false"))
    assert cell_identity(compose_config("buffer=seed001")) == plain  # seed001 is sharded, for the pipeline
    assert cell_identity(compose_config("buffer=seed001", "buffer.batch_rollouts=60")) == plain
    assert cell_identity(compose_config("buffer=seed001", "buffer.capacity=256")) != plain
