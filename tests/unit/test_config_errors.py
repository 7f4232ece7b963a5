"""Bad input is one clear message naming the key (and its value), before any compute, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from hydra import compose, initialize_config_dir

from src.command.config import ConfigError, validate
from src.paths import CONFIG_DIR, PROJECT_ROOT
from src.validate.schema import KNOBS, LIST_KNOBS, SchemaError, check_override_keys, known_keys

# (overrides, the key the message must name)
BAD_OVERRIDES = [
    (["trainer.steps=abc"], "trainer.steps"),
    (["trainer.steps=0"], "trainer.steps"),
    (["trainer.steps=1000000000000"], "trainer.steps"),
    (["trainer.steps=1e12"], "trainer.steps"),
    (["trainer.steps=2.5"], "trainer.steps"),
    (["trainer.groups_per_step=0"], "trainer.groups_per_step"),
    (["trainer.group_size=1"], "trainer.group_size"),
    (["trainer.group_size=abc"], "trainer.group_size"),
    (["trainer.learning_rate=inf"], "trainer.learning_rate"),
    (["trainer.learning_rate=0"], "trainer.learning_rate"),
    (["trainer.learning_rate=-1e-5"], "trainer.learning_rate"),
    (["trainer.betas=[0.9]"], "trainer.betas"),
    (["trainer.betas=[0.9,1.5]"], "trainer.betas"),
    (["trainer.checkpoint_every=abc"], "trainer.checkpoint_every"),
    (["trainer.checkpoint_every=-1"], "trainer.checkpoint_every"),
    (["trainer.micro_batch_size=0"], "trainer.micro_batch_size"),
    (["trainer.rollout.temperature=0"], "trainer.rollout.temperature"),
    (["trainer.rollout.top_p=1.5"], "trainer.rollout.top_p"),
    (["trainer.seed=-1"], "trainer.seed"),
    (["trainer.heartbeat_timeout_s=1"], "trainer.heartbeat_timeout_s"),
    (["trainer.auto_resume=maybe"], "trainer.auto_resume"),
    (["+trainer.stpes=5"], "trainer.stpes"),
    (["buffer.ratio=nan"], "buffer.ratio"),
    (["buffer.ratio=-0.5"], "buffer.ratio"),
    (["buffer.ratio=abc"], "buffer.ratio"),
    (["buffer.ratio=1e9"], "buffer.ratio"),
    (["+buffer.ratoi=2"], "buffer.ratoi"),
    (["buffer.ratoi=2"], "buffer.ratoi"),
    (["buffer=age1", "buffer.max_age=-1"], "buffer.max_age"),
    (["buffer=fifo", "buffer.mode=random"], "buffer.mode"),
    (["buffer=fifo", "buffer.positive_bias=1"], "buffer.positive_bias"),
    (["buffer=age1", "buffer.capacity=0"], "buffer.capacity"),
    (["clip.ceiling=high"], "clip.ceiling"),
    (["clip.ceiling=0"], "clip.ceiling"),
    (["clip.ceiling=inf"], "clip.ceiling"),
    (["evaluation.ks=5"], "evaluation.ks"),
    (["evaluation.ks=[1,16]"], "evaluation.ks"),
    (["evaluation.ks=[0,1]"], "evaluation.ks"),
    (["evaluation.prompts=0"], "evaluation.prompts"),
    (["evaluation.samples_per_prompt=abc"], "evaluation.samples_per_prompt"),
    (["evaluation.temperature=-1"], "evaluation.temperature"),
    (["evaluation.estimator=mean"], "evaluation.estimator"),
    (["evaluation.at_start=perhaps"], "evaluation.at_start"),
    (["+evaluation.kz=[1]"], "evaluation.kz"),
    (["policy.max_new_tokens=0"], "policy.max_new_tokens"),
    (["policy.engine=sglang"], "policy.engine"),
    (["policy.name_or_path=/nonexistent/policy"], "policy.name_or_path"),
    (["hardware.threads=0"], "hardware.threads"),
    (["hardware.dtype=float8"], "hardware.dtype"),
    (["loss=grpo", "loss.eps_low=1.5"], "loss.eps_low"),
    (["loss=grpo", "loss.updates_per_step=2.5"], "loss.updates_per_step"),
    (["sampling=dynamic", "sampling.oversample=0.5"], "sampling.oversample"),
    (["behaviour=stale", "behaviour.lag=-1"], "behaviour.lag"),
    (["curriculum=frontier", "curriculum.fraction=2"], "curriculum.fraction"),
    (["task.train_size=0"], "task.train_size"),
    (["task.min_number=50", "task.max_number=10"], "task.min_number"),
    (["tracking.experiment=[a,b]"], "tracking.experiment"),
    (["trainer.kl_estimator=k4"], "trainer.kl_estimator"),
    (["trainer.kl_estimator=K3"], "trainer.kl_estimator"),
    (["loss=rloo-tis", "loss.is_max=0.5"], "loss.is_max"),
    (["loss=rloo-tis", "loss.is_min=1.5"], "loss.is_min"),
    (["loss=rloo-tis", "loss.is_level=group"], "loss.is_level"),
    (["loss=rloo-tis", "behaviour=stale", "behaviour.is_max=0.5"], "behaviour.is_max"),
    (["behaviour=diverse", "behaviour.is_level=group"], "behaviour.is_level"),
    (["buffer=fifo", "buffer.positive_bias=1"], "buffer.positive_bias"),
]


def refusal(overrides: list[str]) -> str:
    """The message a bad command line gets, in-process: the key check on the command line, then validation."""
    try:
        check_override_keys(overrides)
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            validate(compose("config", overrides=overrides))
    except (SchemaError, ConfigError) as error:
        return str(error)
    raise AssertionError(f"{overrides} was accepted")


def spellings(overrides: list[str]) -> set[str]:
    """How a message may quote the bad value (Hydra parses `1e12` to the float 1000000000000.0)."""
    value = overrides[-1].split("=", 1)[1]
    found = {value, value.strip("[]").split(",")[0]}
    try:
        found |= {repr(float(value)), f"{float(value):g}"}
    except ValueError:
        pass
    return found


@pytest.mark.parametrize("overrides,key", BAD_OVERRIDES, ids=[" ".join(o) for o, _ in BAD_OVERRIDES])
def test_a_bad_override_is_refused_naming_its_key(overrides, key):
    message = refusal(overrides)
    assert key in message, message
    assert "unknown key" in message or any(spelling in message for spelling in spellings(overrides)), message
    assert "\n" not in message and "Traceback" not in message


def test_the_table_is_large_and_the_good_defaults_pass(compose_config):
    assert len(BAD_OVERRIDES) >= 40
    validate(compose_config())


def test_every_ranged_knob_exists_in_the_yaml():
    assert set(KNOBS) | set(LIST_KNOBS) <= known_keys() | set(KNOBS)  # no range for a key no group sets
    assert not (set(KNOBS) | set(LIST_KNOBS)) - known_keys()


def test_int_and_float_spellings_are_one_cell(compose_config):
    from src.study.sweep import cell_identity

    assert cell_identity(compose_config("buffer=age2", "buffer.ratio=1")) == \
        cell_identity(compose_config("buffer=age2", "buffer.ratio=1.0"))
    assert cell_identity(compose_config("clip.ceiling=3")) == cell_identity(compose_config("clip.ceiling=3.0"))


@pytest.fixture
def damaged_policies(tmp_path, random_policy_dir):
    """Copies of a saved policy with one file damaged each: (folder, the damaged file)."""
    import shutil

    made = {}
    for name, damage in (("model.safetensors", lambda b: b[: len(b) // 2]), ("tokenizer.json", lambda b: b""),
                         ("config.json", lambda b: b"{not json")):
        folder = tmp_path / name.replace(".", "_")
        shutil.copytree(random_policy_dir, folder)
        (folder / name).write_bytes(damage((folder / name).read_bytes()))
        made[name] = folder
    return made


@pytest.mark.parametrize("damaged", ["model.safetensors", "tokenizer.json", "config.json"])
def test_a_damaged_policy_file_is_named(damaged_policies, damaged):
    folder = damaged_policies[damaged]
    message = refusal([f"policy.name_or_path={folder}"])
    assert str(folder / damaged) in message and "policy.name_or_path" in message


# --------------------------------------------------------------------------- through the real command line
def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.slow
@pytest.mark.parametrize("override,key", [
    ("trainer.steps=abc", "trainer.steps"),
    ("buffer.ratoi=2", "buffer.ratoi"),
    ("evaluation.ks=5", "evaluation.ks"),
    ("tracking.uri=http://127.0.0.1:{port}", "tracking.uri"),
    ("tracking.uri=garbage", "tracking.uri"),
    ("hydra.run.dir=/proc/no-such/run", "hydra.run.dir"),
    ("trainer.resume_from=/etc/hostname", "trainer.resume_from"),
    ("buffer._target_=src.buffer.age.Nope", "buffer._target_='src.buffer.age.Nope' cannot be imported"),
    # a class whose module needs torch: the check after the imports names it, still in one line
    ("runtime._target_=src.runtime.runners.Nope", "runtime._target_='src.runtime.runners.Nope' cannot be imported"),
])
def test_the_cli_prints_one_message_and_no_traceback(tmp_path, override, key):
    override = override.format(port=closed_port())
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "src.run", f"hydra.run.dir={tmp_path}/run",
                             f"tracking.artifact_location={tmp_path}/artifacts",
                             *([] if key == "tracking.uri" else [f"tracking.uri=sqlite:///{tmp_path}/m.db"]),
                             override], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "HYDRA_FULL_ERROR": "0"})
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-2000:]
    assert key in output and "Traceback" not in output, output[-2000:]
    assert "Loading weights" not in output  # refused before the model loads
    assert time.time() - started < 120
    assert not (tmp_path / "m.db").exists()  # nothing was logged


@pytest.mark.parametrize("target,reason", [("no.such.Store", "No module named 'no'"),
                                           ("src.buffer.age.Nope", "has no attribute 'Nope'")])
def test_a_component_target_that_does_not_import_is_named_before_any_compute(compose_config, target, reason):
    with pytest.raises(ConfigError) as error:
        validate(compose_config(f"buffer._target_={target}"))
    assert f"buffer._target_='{target}'" in str(error.value) and reason in str(error.value)
    validate(compose_config("buffer=age1", "buffer._target_=tests.unit.test_store_plugin.NewestGroupsStore"))  # anywhere


def test_validate_reports_the_constructors_own_check(compose_config):
    """What spans a component's settings is checked once, by the component: validate shows its message."""
    from src.buffer.fifo import FifoReplayBuffer
    from src.rollout.behaviour import BehaviourPolicy

    with pytest.raises(ValueError) as built:
        FifoReplayBuffer(capacity=256, mode="lifo")
    with pytest.raises(ConfigError) as validated:
        validate(compose_config("buffer=fifo", "buffer.mode=lifo"))
    assert str(validated.value) == str(built.value)
    with pytest.raises(ValueError) as built:
        BehaviourPolicy(None, lag=0)
    with pytest.raises(ConfigError) as validated:
        validate(compose_config("behaviour=stale", "behaviour.lag=0"))
    assert str(validated.value) == str(built.value)


def test_a_target_that_does_not_take_its_groups_settings_is_named_before_any_compute(compose_config):
    with pytest.raises(ConfigError, match="ReplayBuffer.*unexpected keyword argument 'mode'"):
        validate(compose_config("buffer=fifo", "buffer._target_=src.buffer.age.ReplayBuffer"))


@pytest.mark.parametrize("uri,experiment,artifacts,key", [
    ("ftp://127.0.0.1/x", "e", None, "tracking.uri=ftp://127.0.0.1/x"),
    ("garbage", "e", None, "tracking.uri=garbage"),
    ("file:///tmp/store", "e", None, "tracking.uri=file:///tmp/store"),
    ("sqlite:////proc/no-such/m.db", "e", None, "tracking.uri=sqlite:////proc/no-such/m.db"),
    ("sqlite:///{tmp}/m.db", "", None, "tracking.experiment=''"),
    ("sqlite:///{tmp}/m.db", "  ", None, "tracking.experiment="),
    ("sqlite:///{tmp}/m.db", "e", "/proc/no-such/artifacts", "tracking.artifact_location=/proc/no-such/artifacts"),
])
def test_a_tracking_setting_that_cannot_work_is_named(tmp_path, uri, experiment, artifacts, key):
    from src.runs.store_check import StoreUnreachable, check_store

    with pytest.raises(StoreUnreachable) as error:
        check_store(uri.format(tmp=tmp_path), experiment, artifacts)
    assert key in str(error.value) and "\n" not in str(error.value)
    assert "sqlite:///" in str(error.value) or "folder" in str(error.value) or "experiment" in str(error.value)


def test_good_tracking_settings_pass(tmp_path):
    from src.runs.store_check import check_store

    check_store(f"sqlite:///{tmp_path}/new/m.db", "replay-rloo", str(tmp_path / "artifacts"))
    assert (tmp_path / "new").is_dir() and (tmp_path / "artifacts").is_dir()
    assert not list((tmp_path / "new").iterdir())  # the write probe leaves nothing behind


def test_resume_from_a_folder_or_a_file_that_is_no_checkpoint_is_named(tmp_path):
    import torch

    from src.runs.lifecycle import CheckpointError, check_resume_from

    (tmp_path / "empty").mkdir()
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"state": {}}, run / "checkpoint.pt")
    text = tmp_path / "notes.txt"
    text.write_text("root:x:0:0\n")
    expected = {str(tmp_path / "empty"): "holds no checkpoint.pt", str(run): f"trainer.resume_from={run}/checkpoint.pt",
                str(text): "not a training checkpoint", str(tmp_path / "missing.pt"): "no such file"}
    for value, fix in expected.items():
        with pytest.raises(CheckpointError) as error:
            check_resume_from(value)
        assert f"trainer.resume_from={value}" in str(error.value) and fix in str(error.value)
    check_resume_from(str(run / "checkpoint.pt"))  # a torch archive passes the cheap check
    check_resume_from(None)


def test_an_unwritable_output_folder_is_named(tmp_path):
    from src.runs.outputs import folder_problem

    assert folder_problem("hydra.run.dir", str(tmp_path / "a" / "b")) is None and (tmp_path / "a" / "b").is_dir()
    # keep=False takes back what the check made, and only that: a/ was there before, c/ and d/ were not.
    assert folder_problem("hydra.sweep.dir", str(tmp_path / "a" / "c" / "d"), keep=False) is None
    assert (tmp_path / "a" / "b").is_dir() and not (tmp_path / "a" / "c").exists()
    problem = folder_problem("hydra.sweep.dir", "/proc/no-such/sweep")
    assert problem.startswith("hydra.sweep.dir=/proc/no-such/sweep: cannot write there")


def test_hardware_h100_without_a_gpu_names_the_device_before_the_engine(compose_config):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: hardware=h100 is valid here")
    with pytest.raises(ConfigError) as error:
        validate(compose_config("hardware=h100"))
    assert "hardware.device='cuda'" in str(error.value) and "hardware=cpu" in str(error.value)


@pytest.mark.parametrize("overrides,message", [
    (["runtime.behaviour_logprobs=both"], "runtime.behaviour_logprobs='both': behaviour_logprobs must be one of "
                                          "forward, engine"),
    (["runtime.behaviour_logprobs=engine", "policy.engine=vllm"],
     "runtime.behaviour_logprobs=engine with policy.engine=vllm: log mu from the engine reads the HF engine's "
     "logits; use runtime.behaviour_logprobs=forward"),
])
def test_log_mu_from_the_engine_is_refused_before_any_compute_where_it_cannot_hold(compose_config, overrides, message):
    validate(compose_config("runtime=async", "runtime.behaviour_logprobs=engine"))  # the HF engine's: accepted
    with pytest.raises(ConfigError) as error:
        validate(compose_config("runtime=async", *overrides))
    assert str(error.value) == message


@pytest.mark.slow
def test_the_cli_refuses_log_mu_from_the_vllm_engine_in_one_line(tmp_path):
    """The words a user types (docs/async.md, "log mu from the engine"), as a subprocess: one line, before any model."""
    result = subprocess.run([sys.executable, "-m", "src.run", "runtime=async", "runtime.behaviour_logprobs=engine",
                             "policy.engine=vllm", f"hydra.run.dir={tmp_path}/run",
                             f"tracking.uri=sqlite:///{tmp_path}/m.db"], cwd=PROJECT_ROOT, capture_output=True,
                            text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output and "Loading weights" not in output, output[-2000:]
    assert output.strip().splitlines()[-1] == (
        "error: runtime.behaviour_logprobs=engine with policy.engine=vllm: log mu from the engine reads the HF "
        "engine's logits; use runtime.behaviour_logprobs=forward")
