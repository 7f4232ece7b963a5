"""A variant is one module and one YAML: copies of the age store and of the RLOO objective, under new names in a
package outside src/ (tests/outside_variants/) and picked from a config folder on Hydra's search path, train,
plan, validate and name their cell exactly as the originals do, with no file under src/ listing them."""

from __future__ import annotations

import re

import pytest

from tests.conftest import wall_clock

from src.study.budget import closed_form_fresh_evaluations, plan_for_config
from src.command.config import ConfigError, validate
from src.paths import PROJECT_ROOT
from src.study.sweep import cell_name, variant_label
from src.task import countdown
from tests.e2e.test_golden import golden_config, run_steps

OUTSIDE = f"hydra.searchpath=[file://{PROJECT_ROOT / 'tests' / 'outside_variants' / 'conf'}]"
COPIES = (OUTSIDE, "buffer=agecopy", "loss=rloocopy")
ORIGINALS = ("buffer=age1", "loss=rloo")


def _comparable(step: dict[str, float]) -> dict[str, float]:
    return {key: value for key, value in step.items() if not wall_clock(key)}  # wall-clock timings differ


def test_the_loss_copy_is_its_per_micro_batch_function_alone():
    """The trainer owns micro-batches, every row's inputs, backward, the KL and entropy terms, clipping and steps:
    what a new loss writes is its settings and its term, in at most 40 lines, borrowing nothing of loss=rloo's
    module (only the maths of eqs. 2 and 3)."""
    import inspect

    from tests.outside_variants import variants
    from tests.outside_variants.variants import RlooCopy

    lines = inspect.getsource(RlooCopy).splitlines()
    assert len(lines) <= 40, f"RlooCopy is {len(lines)} lines"
    assert not re.search(r"backward|zero_grad|\.step\(|kl_coef|entropy_coef|prepare", inspect.getsource(RlooCopy))
    assert not re.search(r"^from src\.loss\.rloo import", inspect.getsource(variants), re.M)


@pytest.mark.parametrize("behaviour", [
    [],                                                  # fresh rows on-policy: weight 1; replayed rows eq. 2
    ["behaviour=diverse", "behaviour.is_level=token"],   # fresh rows of a tempered sampler: seed 002's token IS
])
def test_the_copies_train_with_the_originals_metrics(compose_config, behaviour):
    train_set = countdown.generate_instances(64, seed=1)
    copies = run_steps(golden_config(compose_config, (*COPIES, *behaviour)), train_set, steps=2)
    originals = run_steps(golden_config(compose_config, (*ORIGINALS, *behaviour)), train_set, steps=2)
    assert [step["batch/replay_groups"] for step in copies] == [0, 2]  # the copy's store did replay
    if behaviour:  # the copy's truncated IS weighed the sampler's fresh rows
        assert any(step["weights/raw_mean/fresh"] != 1.0 for step in copies)
    assert [_comparable(step) for step in copies] == [_comparable(step) for step in originals]


def test_a_store_copy_in_both_forms_trains_the_step_as_its_original(compose_config):
    """buffer=lifocopy (tests/outside_variants/rollouts.py) is buffer=none's copy: fresh-only in the synchronous
    step; its rollout form, the LIFO pipe, trains under runtime=async in tests/e2e/test_runtime_ray.py."""
    train_set = countdown.generate_instances(64, seed=1)
    copy = run_steps(golden_config(compose_config, (OUTSIDE, "buffer=lifocopy")), train_set, steps=2)
    original = run_steps(golden_config(compose_config, ("buffer=none",)), train_set, steps=2)
    assert [_comparable(step) for step in copy] == [_comparable(step) for step in original]
    assert cell_name(compose_config(OUTSIDE, "buffer=lifocopy")) == cell_name(compose_config("buffer=none"))


@pytest.mark.parametrize("overrides", [
    ["trainer=paper"],                                                        # 100 steps of B=128, K=8
    ["buffer.ratio=2", "buffer.allow_infeasible=true"],                       # rho > L: gap fill every step
    ["buffer.max_age=3", "buffer.ratio=2", "buffer.capacity=640", "trainer.steps=30"],  # 40 groups of 16 cut the pool
])
def test_the_copies_plan_the_same_budget(compose_config, overrides):
    copy, original = compose_config(*COPIES, *overrides), compose_config(*ORIGINALS, *overrides)
    assert plan_for_config(copy) == plan_for_config(original)


def test_the_copies_name_and_check_their_cell_from_their_own_description(compose_config):
    copy, original = compose_config(*COPIES, "buffer.max_age=2", "clip=tight"), compose_config("buffer=age2", "clip=tight")
    validate(copy, check_device=False)
    assert cell_name(copy) == cell_name(original) == "rho1-L2-c1"
    assert variant_label(copy) == variant_label(original) == "Replay-RLOO"
    assert cell_name(compose_config(*COPIES, "buffer.ratio=0")) == "rho0"  # fresh-only: no clip in the name
    with pytest.raises(ConfigError) as error:  # the copy's own feasibility check, one line
        validate(compose_config(*COPIES, "buffer.ratio=2"), check_device=False)
    assert "buffer.ratio rho=2 > buffer.max_age L=1" in str(error.value) and "\n" not in str(error.value)


def test_a_name_key_is_a_label_only(compose_config):
    """The YAML's `name` is for people: the class, not the name, decides the cell's name and plan."""
    renamed = compose_config("buffer=age2", "clip=tight", "buffer.name=whatever", "loss.name=ppo")
    validate(renamed, check_device=False)
    assert cell_name(renamed) == "rho1-L2-c1"
    assert plan_for_config(renamed) == plan_for_config(compose_config("buffer=age2", "clip=tight"))


def test_the_readme_variant_is_its_two_files(compose_config, tmp_path, monkeypatch):
    """README's "Add a variant" section: its module and its YAML, written as shown, make a runnable store."""
    text = (PROJECT_ROOT / "README.md").read_text()
    section = text[text.index("### Add a variant"):]
    section = section[:section.index("\n### ")]
    blocks = re.findall(r"```(?:python|yaml)\n# (\S+)\n(.*?)```", section, re.S)
    assert [path for path, _ in blocks] == ["my_variants/newest.py", "my_conf/buffer/newest.yaml"]
    for path, body in blocks:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    searchpath = f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]"
    cfg = compose_config(searchpath, "buffer=newest")
    validate(cfg, check_device=False)
    assert cell_name(cfg) == "newest-rho1-N64-c10" and variant_label(cfg) == "Newest-first replay"
    trainer = cfg.trainer  # it keeps 64 >= B_replay groups: no gap fill after step 0, the paper's formula holds
    assert plan_for_config(cfg).fresh_evaluations == closed_form_fresh_evaluations(
        trainer.groups_per_step, trainer.group_size, trainer.steps, 1.0)
    with pytest.raises(ConfigError, match="buffer.capacity=2 < trainer.groups_per_step"):
        validate(compose_config(searchpath, "buffer=newest", "buffer.capacity=2"), check_device=False)


def test_an_override_of_a_key_only_a_searchpath_yaml_sets_is_known(tmp_path):
    from src.validate.schema import SchemaError, check_override_keys

    (tmp_path / "buffer").mkdir()
    (tmp_path / "buffer" / "mine.yaml").write_text("_target_: my.Store\nratio: 1.0\nwindow_size: 3\n")
    with pytest.raises(SchemaError, match="buffer.window_size: unknown key"):
        check_override_keys(["buffer=mine", "buffer.window_size=4"])
    check_override_keys([f"hydra.searchpath=[file://{tmp_path}]", "buffer=mine", "buffer.window_size=4"])
