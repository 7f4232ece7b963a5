"""The runtime config group: sync stays the default and the same cells; async settings are checked before any compute."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from src.build import build_runtime, build_store
from src.config import ConfigError, validate
from src.runtime.runners import AsyncRuntime, PipelineStore, SyncRuntime
from src.sweep import cell_identity, cell_name


def test_sync_is_the_default_and_keeps_the_step_store_and_cell_ids(compose_config):
    cfg = compose_config()
    assert isinstance(build_runtime(cfg), SyncRuntime) and not isinstance(build_store(cfg), PipelineStore)
    assert cell_identity(cfg) == cell_identity(compose_config("runtime=sync"))
    without = OmegaConf.create(OmegaConf.to_container(cfg))
    del without["runtime"]  # a run's config saved before the group existed
    assert cell_identity(without) == cell_identity(cfg) and isinstance(build_runtime(without), SyncRuntime)


def test_async_builds_the_pipeline_store_and_its_own_cells(compose_config):
    cfg = compose_config("runtime=async", "runtime.workers=6", "runtime.trainers=2", "runtime.capacity=768")
    validate(cfg, check_device=False)
    runtime = build_runtime(cfg)
    assert isinstance(runtime, AsyncRuntime) and runtime.settings.batch == 32 * 16
    assert isinstance(build_store(cfg), PipelineStore)
    assert cell_name(cfg).endswith("-W6T2-N768")
    assert cell_name(compose_config("runtime=async", "runtime.queue=lifo")).endswith("-W2T1-lifo")
    launch_only = compose_config("runtime=async", "runtime.workers=6", "runtime.trainers=2", "runtime.capacity=768",
                                 "runtime.num_cpus=8")
    assert cell_identity(launch_only) == cell_identity(cfg) != cell_identity(compose_config())


@pytest.mark.parametrize("overrides, words", [
    (("runtime.capacity=100",), "runtime.capacity N=100 < B"),
    (("runtime.queue=fifo",), "runtime.queue='fifo'"),
    (("runtime.schedule=free", "runtime.trainers=2"), "runtime.trainers=2 with runtime.schedule=free"),
    (("buffer=age2",), "buffer=age2 with runtime=async"),
    (("sampling=dynamic",), "sampling=dynamic"),
    (("runtime.queue=lifo", "runtime.positive_bias=0.5"), "positive_bias=0.5"),
    (("runtime.workers=0",), "runtime.workers"),
    (("runtime.staleness_mode=wait",), "runtime.staleness_mode='wait'"),
    (("runtime.mu=0",), "runtime.mu=0"),
    (("runtime.sharded=true", "runtime.trainers=3", "runtime.capacity=1536"), "cannot be split over 3 shards"),
])
def test_bad_async_settings_are_one_line_naming_the_key(compose_config, overrides, words):
    cfg = compose_config("runtime=async", *overrides)
    with pytest.raises(ConfigError) as error:
        validate(cfg, check_device=False)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_the_budget_plan_of_an_async_run_follows_its_lockstep_schedule(compose_config):
    from src.budget import plan_for_config

    cfg = compose_config("runtime=async", "trainer.groups_per_step=2", "trainer.group_size=4", "trainer.steps=5",
                         "runtime.capacity=32", "runtime.groups_per_request=1")
    plan = plan_for_config(cfg)
    # W = 2, mu = 4: each worker makes a group every 2 steps; step 0 waits for the first two (the Ray tests' run)
    assert plan.fresh_groups_per_step == (2, 0, 2, 0, 2) and plan.fresh_evaluations == 24
