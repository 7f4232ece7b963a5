"""Config groups compose, every option of every group works, and bad configs fail before compute."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from src.command import config
from src.command.config import ConfigError, validate
from src import help as cli_help
from src.paths import CONFIG_DIR

GROUPS = ["task", "policy", "trainer", "buffer", "clip", "loss", "sampling", "behaviour", "curriculum", "evaluation",
          "hardware"]


def options(group: str) -> list[str]:
    return [path.stem for path in cli_help.options(CONFIG_DIR / group)]


def test_required_options_exist():
    assert {"none", "age1", "age2", "age3"} <= set(options("buffer"))
    assert {"tight", "mid", "loose", "stress"} <= set(options("clip"))
    assert {"tiny", "qwen2.5-0.5b", "qwen-sft-countdown"} <= set(options("policy"))
    assert {"quick", "canonical", "probe"} <= set(options("evaluation"))
    assert {"cpu", "h100"} <= set(options("hardware"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes(compose_config, group, option, monkeypatch):
    monkeypatch.setattr(config, "_hub_problem", lambda name, endpoint: None)  # a hub policy: the hub would answer
    # Seed 001's FIFO preset is the pipeline's at seed 001's batch of B = 60 rollouts (its header; D.2): its N = 252
    # rollouts are fewer than the tiny B = 512, and hold 15 groups of the tiny K = 16, fewer than the synchronous
    # step's B_replay = 16 distinct draws; validation refuses both.
    pipeline = ["runtime=async", "buffer.batch_rollouts=60"] if (group, option) == ("buffer", "seed001") else []
    cfg = compose_config(f"{group}={option}", *pipeline, hydra=True)
    assert cfg[group] is not None
    if group == "hardware" and option != "cpu":
        return  # a CUDA device is checked at validation time, on the machine that runs it
    validate(cfg)


def test_default_is_the_cpu_fresh_only_tiny_run(compose_config):
    cfg = compose_config()
    assert (cfg.policy.name_or_path, cfg.hardware.device, cfg.buffer.ratio) == ("checkpoints/tiny-countdown", "cpu", 0)


@pytest.mark.parametrize("option,ceiling", [("tight", 1), ("mid", 3), ("loose", 10), ("stress", 1000)])
def test_clip_ceilings(compose_config, option, ceiling):
    assert compose_config(f"clip={option}").clip.ceiling == ceiling


@pytest.mark.parametrize("option,max_age", [("age1", 1), ("age2", 2), ("age3", 3)])
def test_buffer_ages_default_to_ratio_one(compose_config, option, max_age):
    cfg = compose_config(f"buffer={option}")
    assert (cfg.buffer.max_age, cfg.buffer.ratio) == (max_age, 1.0)
    assert compose_config(f"buffer={option}", "buffer.ratio=0.5").buffer.ratio == 0.5


def test_qwen_policies_bring_the_paper_trainer_unless_overridden(compose_config):
    cfg = compose_config("policy=qwen-sft-countdown")
    assert (cfg.trainer.groups_per_step, cfg.trainer.group_size, cfg.trainer.steps) == (128, 8, 100)
    assert cfg.trainer.learning_rate == 1e-5
    assert cfg.policy.name_or_path == "amulyaparthasarathy/qwen-sft-countdown"
    assert compose_config("policy=qwen-sft-countdown", "trainer=tiny").trainer == compose_config().trainer


def test_h100_selects_the_submitit_slurm_launcher(compose_config):
    cfg = compose_config("hardware=h100", "policy=qwen-sft-countdown", hydra=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.gpus_per_node == 1
    assert (cfg.hardware.device, cfg.hardware.dtype, cfg.hardware.autocast) == ("cuda", "float32", "bfloat16")
    assert cfg.policy.engine == "vllm" and 0 < cfg.policy.vllm.gpu_memory_utilization < 1
    cpu = compose_config(hydra=True)
    assert cpu.hydra.launcher._target_.endswith("BasicLauncher")


@pytest.mark.parametrize("overrides,words", [
    (["buffer=age1", "buffer.ratio=2"], ["rho=2", "L=1"]),
    (["buffer=age2", "buffer.ratio=2.5"], ["rho=2.5", "L=2"]),
    (["buffer=none", "buffer.ratio=1"], ["rho=1", "age1"]),
    (["clip.ceiling=0"], ["clip.ceiling=0", "0 < value", "ceiling"]),
    (["clip.ceiling=-1"], ["clip.ceiling=-1", "0 < value"]),
    (["trainer.group_size=1"], ["trainer.group_size=1", "K >= 2"]),
    (["buffer.ratio=-0.5"], ["buffer.ratio=-0.5", "0 <= value", "fresh-only"]),
    (["trainer.groups_per_step=1", "buffer=age1"], ["B_fresh", "0"]),
    (["trainer.groups_per_step=0"], ["groups_per_step=0", "1 <= value"]),
    (["policy.engine=sglang"], ["sglang", "hf"]),
    (["policy.engine=vllm", "policy.vllm.gpu_memory_utilization=1.5"], ["gpu_memory_utilization=1.5"]),
    (["hardware.autocast=int8"], ["int8", "bfloat16"]),
    (["trainer.micro_batch_tokens=0"], ["micro_batch_tokens=0"]),
    (["trainer.pack_rows=3"], ["trainer.pack_rows=3", "true or false"]),
    (["trainer.compile=yes"], ["trainer.compile='yes'", "true or false"]),
    (["evaluation.estimator=mean"], ["mean", "first_k"]),
    (["evaluation.ks=[1,16]"], ["[16]", "samples_per_prompt"]),
    (["evaluation.prompts=80"], ["80", "heldout_size"]),
])
def test_invalid_configs_are_refused_with_the_value_and_the_fix(compose_config, overrides, words):
    with pytest.raises(ConfigError) as error:
        validate(compose_config(*overrides))
    for word in words:
        assert word in str(error.value)


def test_infeasible_ratio_can_be_allowed_explicitly(compose_config):
    validate(compose_config("buffer=age1", "buffer.ratio=2", "buffer.allow_infeasible=true"))


def test_unknown_option_names_are_refused_by_hydra_with_the_choices(compose_config):
    with pytest.raises(MissingConfigException) as error:
        compose_config("buffer=age9")
    assert "age9" in str(error.value) and "age2" in str(error.value)
    with pytest.raises(MissingConfigException):
        compose_config("clip=tigth")


def test_unknown_keys_are_refused(compose_config):
    with pytest.raises((ConfigCompositionException, ConfigAttributeError, ConfigKeyError)) as error:
        compose_config("buffer.ratoi=2")
    assert "ratoi" in str(error.value)


def test_every_yaml_knob_is_read_by_the_code():
    """Each leaf key of the config groups must appear in the source (configs are the single source of truth)."""
    from omegaconf import OmegaConf

    from src.paths import PROJECT_ROOT

    source = "\n".join(path.read_text() for path in (PROJECT_ROOT / "src").rglob("*.py"))
    source += "\n".join(path.read_text() for path in (PROJECT_ROOT / "analysis").rglob("*.py"))
    unread = []
    for group in GROUPS:
        for path in (CONFIG_DIR / group).glob("*.yaml"):
            node = OmegaConf.to_container(OmegaConf.load(path))
            node = node.get(group, node)  # `# @package _global_` files nest their keys under the group
            for key in _leaf_keys({k: v for k, v in node.items() if k not in ("defaults", "hydra")}):
                if key == "name":  # option names become tags (src/runs/naming.py)
                    continue
                # Read as an attribute, a string key, or a keyword argument (groups passed on with **).
                if not any(form in source for form in (f".{key}", f'"{key}"', f"['{key}']", f"{key}={key}")):
                    unread.append(f"{group}/{path.stem}: {key}")
    assert not unread, f"config keys no code reads: {unread}"


def _leaf_keys(node):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaf_keys(value)
        else:
            yield key


def test_site_example_config_composes_with_h100(tmp_path, compose_config):
    """launch/site-example.yaml, copied to conf/local/<site>.yaml, sets the cluster's launcher and tracking."""
    import shutil

    from hydra import compose, initialize_config_dir

    from src.paths import PROJECT_ROOT

    site = tmp_path / "local"
    site.mkdir()
    shutil.copy(PROJECT_ROOT / "launch" / "site-example.yaml", site / "mysite.yaml")
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["hardware=h100", f"hydra.searchpath=[file://{tmp_path}]", "+local=mysite"],
                      return_hydra_config=True)
    assert (cfg.hydra.launcher.partition, cfg.hydra.launcher.account) == ("gpu", "my-account")
    assert cfg.tracking.uri == "http://login01:5000" and cfg.hydra.launcher.gpus_per_node == 1
