"""Clean stops, full disks and dead runs: Ctrl-C resumes, a full disk is one line, a dead run never stays RUNNING."""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest
import torch
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from src.settings import RunSettings
import src.runs.checkpoint
from src.study.labels import cell_of
from src.runs.checkpoint import CheckpointError, payload_bytes, read_checkpoint, read_latest_checkpoint, save_checkpoint
from src.runs.diskspace import DiskFull, out_of_space, size_text
from src.runs.interrupt import Interrupted, StopOnSignal, StopRequested
from src.runs.lifecycle import RUN_END_FILE, read_run_end, remove_stale_temporaries, write_heartbeat
from src.paths import PROJECT_ROOT
from src.batch import TrainState
from tests.e2e.test_lifecycle import a_dead_pid, assert_same_metrics_no_duplicates, fake_parts, make_run
from tests.e2e.test_sweep import store, tiny_cli

HOST = socket.gethostname()


# --------------------------------------------------------------------------- recognising a full disk
@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    OSError(errno.EDQUOT, "Disk quota exceeded"),
    Exception("Error while serializing: I/O error: No space left on device (os error 28)"),  # safetensors
    MlflowException("(sqlite3.OperationalError) database or disk is full"),
])
def test_a_full_disk_is_recognised_in_each_library_s_words(error):
    assert out_of_space(error)


def test_a_full_disk_is_recognised_behind_the_error_raised_while_handling_it():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # torch
    except RuntimeError as error:
        assert out_of_space(error)
    assert not out_of_space(OSError(errno.EACCES, "Permission denied"))
    assert not out_of_space(RuntimeError("simulated crash"))


# --------------------------------------------------------------------------- checkpoint writes
def two_generations(folder: Path) -> Path:
    path = folder / "checkpoint.pt"
    save_checkpoint(path, fake_parts(1), TrainState(step=1), "run-1", "cell-1")
    save_checkpoint(path, fake_parts(2), TrainState(step=2), "run-1", "cell-1")
    return path


def failing_torch_save(payload, handle):
    handle.write(b"half a checkpoint")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_checkpoint_that_does_not_fit_leaves_the_previous_one_loading_and_no_partial_file(tmp_path, monkeypatch):
    path = two_generations(tmp_path)
    monkeypatch.setattr(src.runs.checkpoint.torch, "save", failing_torch_save)
    parts = fake_parts(3)
    with pytest.raises(DiskFull) as error:
        save_checkpoint(path, parts, TrainState(step=3), "run-1", "cell-1")
    message = str(error.value)
    assert "\n" not in message and str(path) in message
    assert f"needs about {size_text(error.value.needed_bytes)} free" in message
    assert error.value.needed_bytes >= payload_bytes(parts.policy.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]  # no .tmp
    payload, used = read_latest_checkpoint(tmp_path)
    assert used == path and payload["state"]["step"] == 2


def test_a_rename_that_runs_out_of_space_still_leaves_a_checkpoint_that_loads(tmp_path, monkeypatch):
    path = two_generations(tmp_path)
    real_replace = os.replace

    def replace(source, target):
        if str(source).endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        real_replace(source, target)

    monkeypatch.setattr(src.runs.checkpoint.os, "replace", replace)
    with pytest.raises(DiskFull, match="checkpoint"):
        save_checkpoint(path, fake_parts(3), TrainState(step=3), "run-1", "cell-1")
    assert not list(tmp_path.glob("*.tmp"))
    payload, used = read_latest_checkpoint(tmp_path)
    assert payload["state"]["step"] == 2  # the step-2 checkpoint, now the previous generation


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MB tmpfs (root only; skipped where mounting is not allowed)."""
    folder = tmp_path / "tmpfs"
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root and CAP_SYS_ADMIN")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_checkpoint_on_a_really_full_disk(tiny_tmpfs):
    """On a real 1 MB tmpfs: three 400 KB generations do not fit; the third fails as DiskFull and frees its space."""
    torch.manual_seed(0)
    policy = torch.nn.Linear(400, 256)  # about 400 KB of weights
    parts = SimpleNamespace(policy=policy, optimizer=torch.optim.SGD(policy.parameters(), lr=0.1), **{
        key: getattr(fake_parts(0), key) for key in ("buffer", "curriculum", "behaviour")})
    path = tiny_tmpfs / "checkpoint.pt"
    save_checkpoint(path, parts, TrainState(step=1), "run-1", "cell-1")
    save_checkpoint(path, parts, TrainState(step=2), "run-1", "cell-1")
    with pytest.raises(DiskFull) as error:
        save_checkpoint(path, parts, TrainState(step=3), "run-1", "cell-1")
    assert error.value.free_bytes < error.value.needed_bytes
    assert str(path) in str(error.value) and size_text(error.value.free_bytes) in str(error.value)
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]
    assert read_checkpoint(path)["state"]["step"] == 2


def test_leftovers_of_killed_writers_are_removed_and_a_live_writer_s_kept(tmp_path):
    dead, old = a_dead_pid(), time.time() - 3600
    names = {
        f"checkpoint.pt.{dead}@{HOST}.0123abcd.tmp": True,  # killed on this host
        f"checkpoint.pt.{dead}.0123abcd.tmp": True,  # an older name without the host
        f"checkpoint.pt.{os.getpid()}@{HOST}.0123abcd.tmp": False,  # this live process
        "checkpoint.pt.1234@elsewhere.node.0123abcd.tmp": False,  # another host, written just now
        "heartbeat.json.1234@elsewhere.node.4567cdef.tmp": True,  # another host, untouched for an hour
        "notes.tmp": False,  # not a writer's temporary
    }
    for name in names:
        (tmp_path / name).write_bytes(b"partial")
    os.utime(tmp_path / "heartbeat.json.1234@elsewhere.node.4567cdef.tmp", (old, old))
    removed = remove_stale_temporaries(tmp_path, timeout_s=120)
    assert sorted(p.name for p in removed) == sorted(name for name, stale in names.items() if stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(name for name, stale in names.items() if not stale)


def test_the_fallback_warning_says_in_our_words_which_file_was_damaged_and_which_loaded(tmp_path, caplog):
    path = two_generations(tmp_path)
    path.write_bytes(path.read_bytes()[:300])
    with caplog.at_level(logging.WARNING):
        payload, used = read_latest_checkpoint(tmp_path)
    assert payload["state"]["step"] == 1
    assert f"{path} is damaged" in caplog.text and f"loaded the previous checkpoint {used} (step 1)" in caplog.text
    assert "weights_only" not in caplog.text and "Re-running" not in caplog.text

    torch.save({"policy": SimpleNamespace(), "state": {}, "run_id": "x"}, path)  # loads only with code execution
    with pytest.raises(CheckpointError) as error:
        read_checkpoint(path)
    assert "refused, since loading it could run code" in str(error.value) and "weights_only" not in str(error.value)


# --------------------------------------------------------------------------- the signal handler
HANDLER_SCRIPT = """
import os, signal, time
from src.runs.interrupt import StopOnSignal, StopRequested
with StopOnSignal() as stop:
    os.kill(os.getpid(), signal.SIGINT)  # during a step: recorded only
    time.sleep(0.2)
    print("recorded", stop.requested == signal.SIGINT, flush=True)
    try:
        with stop.abandonable():
            pass
    except StopRequested:
        print("abandonable work refused", flush=True)
    os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C
    time.sleep(5)
    print("still running", flush=True)
"""


def test_a_second_ctrl_c_exits_at_once_without_a_traceback():
    result = subprocess.run([sys.executable, "-c", HANDLER_SCRIPT], cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 130
    assert result.stdout.split("\n")[:2] == ["recorded True", "abandonable work refused"]
    assert "still running" not in result.stdout and "Traceback" not in result.stderr
    assert "Ctrl-C again: stopped at once. The run resumes from its last complete checkpoint" in result.stderr


def test_a_stop_signal_cuts_abandonable_work_short_and_ctrl_c_exits_130_not_keyboardinterrupt():
    before, before_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopOnSignal() as stop:
        with pytest.raises(StopRequested) as request:
            with stop.abandonable():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler raises before this ends
        assert request.value.signum == signal.SIGINT
        with pytest.raises(Interrupted) as stopped:  # Python's own handler would raise KeyboardInterrupt
            stop.hand_on()
    assert stopped.value.code == 130
    assert signal.getsignal(signal.SIGTERM) == before_term  # the earlier handler is back
    # but not Python's SIGINT handler: the process is ending, and a Ctrl-C while it ends exits at once
    assert before is signal.default_int_handler and signal.getsignal(signal.SIGINT) is not before
    signal.signal(signal.SIGINT, before)


HANDED_ON_SCRIPT = """
import atexit, os, signal, time
from src.runs.interrupt import Interrupted, StopOnSignal
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(5), print("still running", flush=True)))
with StopOnSignal() as stop:
    os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: the step ends, then the process
    time.sleep(0.2)
    stop.hand_on()
"""


def test_a_ctrl_c_while_a_stopped_process_exits_is_the_one_line_not_a_finalizers_traceback():
    result = subprocess.run([sys.executable, "-c", HANDED_ON_SCRIPT], cwd=PROJECT_ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 130 and "still running" not in result.stdout, result.stderr
    assert "Traceback" not in result.stderr and "Ctrl-C again: stopped at once" in result.stderr, result.stderr


# --------------------------------------------------------------------------- training in-process
def hydra_job_config(compose_config, tmp_path, *overrides):
    """A composed config as `@hydra.main` hands it to the job, with Hydra's runtime set for `src.run.train`."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    cfg = compose_config(*overrides, f"tracking.uri={store(tmp_path)}", f"tracking.artifact_location={tmp_path}/art",
                         f"hydra.run.dir={tmp_path}/run", hydra=True)
    cfg.hydra.runtime.output_dir = str(tmp_path / "run")
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


TINY = ["trainer.steps=2", "trainer.groups_per_step=2", "trainer.group_size=2", "policy.max_new_tokens=4",
        "evaluation.prompts=2", "evaluation.samples_per_prompt=2", "evaluation.ks=[1]", "trainer.checkpoint_every=1",
        "tracking.sweep=stops"]


def all_runs(tmp_path):
    mlflow.set_tracking_uri(store(tmp_path))
    return mlflow.search_runs(experiment_names=["replay-rloo"])


def sigint_then(function):
    """`function`, after a Ctrl-C to this process that lands while it runs."""
    def wrapped(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # the handler runs here
        return function(*args, **kwargs)
    return wrapped


@pytest.mark.slow
def test_ctrl_c_while_the_model_loads_stops_before_any_run_exists(tmp_path, random_policy_dir, compose_config,
                                                                   monkeypatch, caplog):
    import src.run
    import src.train

    cfg = hydra_job_config(compose_config, tmp_path, f"policy.name_or_path={random_policy_dir}", *TINY)
    monkeypatch.setattr(src.run, "build_components", sigint_then(src.run.build_components))
    with caplog.at_level(logging.WARNING), pytest.raises(Interrupted) as stopped:
        src.run.train(cfg)
    assert stopped.value.code == 130
    assert "Ctrl-C before training began: nothing to save" in caplog.text
    assert len(all_runs(tmp_path)) == 0


@pytest.mark.slow
def test_ctrl_c_during_an_evaluation_stops_with_a_checkpoint_and_the_next_start_continues(
        tmp_path, random_policy_dir, compose_config, monkeypatch, caplog):
    import src.run
    import src.train

    cfg = hydra_job_config(compose_config, tmp_path, f"policy.name_or_path={random_policy_dir}", *TINY,
                           "evaluation.at_start=true")
    real_evaluate = src.run.evaluate_policy
    monkeypatch.setattr(src.run, "evaluate_policy", sigint_then(real_evaluate))
    with caplog.at_level(logging.WARNING), pytest.raises(Interrupted) as stopped:
        src.run.train(cfg)
    assert stopped.value.code == 130
    killed = all_runs(tmp_path)
    assert list(killed.status) == ["KILLED"]
    assert read_checkpoint(tmp_path / "run" / "checkpoint.pt")["state"]["step"] == 0
    assert "stopped after step 0 of 2" in caplog.text and "run the same command to continue" in caplog.text

    monkeypatch.setattr(src.run, "evaluate_policy", real_evaluate)
    src.run.train(cfg)
    after = all_runs(tmp_path)
    assert list(after.status) == ["FINISHED"] and after.run_id[0] == killed.run_id[0]
    client = MlflowClient(store(tmp_path))
    assert [m.step for m in client.get_metric_history(after.run_id[0], "quick/start/mean_reward")] == [0]
    assert sorted(m.step for m in client.get_metric_history(after.run_id[0], "train/reward")) == [0, 1]


@pytest.mark.slow
def test_ctrl_c_that_breaks_a_step_off_keeps_the_last_complete_checkpoint(tmp_path, random_policy_dir,
                                                                         compose_config, monkeypatch, caplog):
    """A helper process (vLLM's engine) dies of the same Ctrl-C: the half step is dropped, not checkpointed."""
    import src.run
    import src.train

    cfg = hydra_job_config(compose_config, tmp_path, f"policy.name_or_path={random_policy_dir}", *TINY,
                           "trainer.steps=3", "evaluation.at_start=false")
    real_learn, calls = src.train.learn, []

    def engine_dies_on_the_second_step(parts, state, collection):
        calls.append(1)
        if len(calls) == 2:
            sigint_then(lambda: None)()
            raise RuntimeError("engine core died")
        return real_learn(parts, state, collection)

    monkeypatch.setattr(src.train, "learn", engine_dies_on_the_second_step)
    with caplog.at_level(logging.WARNING), pytest.raises(Interrupted):
        src.run.train(cfg)
    assert list(all_runs(tmp_path).status) == ["KILLED"]
    assert read_checkpoint(tmp_path / "run" / "checkpoint.pt")["state"]["step"] == 1
    assert "stopped during step 2 of 3, checkpoint at step 1" in caplog.text


def test_a_store_that_refuses_the_end_leaves_run_end_json_and_one_line(tmp_path, compose_config, monkeypatch):
    from src.runs import tracking
    from src.study.labels import run_labels

    cfg = compose_config(f"tracking.uri={store(tmp_path)}", f"tracking.artifact_location={tmp_path}/art")
    full = MlflowException("(sqlite3.OperationalError) database or disk is full")
    folder = tmp_path / "run"
    with pytest.raises(DiskFull) as error:
        with tracking.start_run(RunSettings(cfg).tracking, run_labels(cfg), folder=folder) as tracker:
            monkeypatch.setattr(mlflow, "set_tag", lambda *args: (_ for _ in ()).throw(full))
            monkeypatch.setattr(MlflowClient, "set_terminated", lambda *args, **kwargs: (_ for _ in ()).throw(full))
            raise full  # a metric write into the full store
    assert str(tmp_path / "mlruns.db") in str(error.value) and "needs about 1.0 MB" in str(error.value)
    assert MlflowClient(store(tmp_path)).get_run(tracker.run_id).info.status == "RUNNING"  # as the store kept it
    end = read_run_end(folder)
    assert end["run_id"] == tracker.run_id and end["status"] == "FAILED" and "no space left" in end["reason"]
    assert mlflow.active_run() is None  # nothing will mark it FINISHED at exit


def test_a_crash_is_failed_with_its_reason_and_a_resume_clears_both(tmp_path, compose_config):
    from src.runs import tracking
    from src.study.labels import run_labels

    cfg = compose_config(f"tracking.uri={store(tmp_path)}", f"tracking.artifact_location={tmp_path}/art")
    folder = tmp_path / "run"
    with pytest.raises(ZeroDivisionError):
        with tracking.start_run(RunSettings(cfg).tracking, run_labels(cfg), folder=folder) as tracker:
            1 / 0
    run = MlflowClient(store(tmp_path)).get_run(tracker.run_id)
    assert run.info.status == "FAILED" and run.data.tags["failure_reason"] == "ZeroDivisionError: division by zero"

    folder.mkdir()
    (folder / RUN_END_FILE).write_text(f'{{"run_id": "{tracker.run_id}", "status": "FAILED"}}')
    with tracking.start_run(RunSettings(cfg).tracking, run_labels(cfg), tracker.run_id, folder=folder):
        pass
    run = MlflowClient(store(tmp_path)).get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and "failure_reason" not in run.data.tags
    assert not (folder / RUN_END_FILE).exists()


def test_a_final_policy_that_does_not_fit_leaves_no_half_policy(tmp_path):
    from src.run import save_final_policy

    def save_half(folder):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    policy = torch.nn.Linear(100, 100)
    policy.save_pretrained = save_half
    with pytest.raises(DiskFull) as error:
        save_final_policy(SimpleNamespace(policy=policy, tokenizer=None), tmp_path / "policy")
    assert f"needs about {size_text(payload_bytes(policy.state_dict()))}" in str(error.value)
    assert not (tmp_path / "policy").exists()


def test_a_dead_run_whose_checkpoints_are_all_damaged_is_marked_failed(tmp_path, compose_config):
    from src.runs.resume import choose_start
    from src.study.sweep import cell_identity

    cfg = hydra_job_config(compose_config, tmp_path, "trainer.steps=3")
    folder = tmp_path / "dead"
    run_id = make_run(store(tmp_path), cfg, "RUNNING", folder)
    write_heartbeat(folder, run_id)
    (folder / "heartbeat.json").write_text((folder / "heartbeat.json").read_text().replace(
        f'"pid": {os.getpid()}', f'"pid": {a_dead_pid()}'))
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        (folder / name).write_bytes(b"truncated")
    start = choose_start(RunSettings(cfg), cell_of(cfg, cell_identity(cfg)), tmp_path / "fresh")
    assert start.run_id != run_id and start.checkpoint is None  # the cell starts afresh, in a new run
    run = MlflowClient(store(tmp_path)).get_run(run_id)
    assert run.info.status == "FAILED" and "not resumable" in run.data.tags["failure_reason"]


# --------------------------------------------------------------------------- end to end, in a subprocess
CELL = ["buffer=age1", "clip=tight", "trainer.steps=6", "trainer.checkpoint_every=1", "tracking.sweep=stops"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, random_policy_dir):
    """(store, run id) of the cell trained without interruption."""
    folder = tmp_path_factory.mktemp("reference")
    subprocess.run([*tiny_cli(folder, random_policy_dir, *CELL), f"hydra.run.dir={folder}/run"], cwd=PROJECT_ROOT,
                   check=True, capture_output=True)
    mlflow.set_tracking_uri(store(folder))
    return store(folder), mlflow.search_runs(experiment_names=["replay-rloo"]).run_id[0]


def interrupt_when(command: list[str], text: str, timeout_s: float = 300) -> tuple[int, str]:
    """Run `command`; send SIGINT (Ctrl-C) when a line containing `text` appears. Exit status and all output."""
    process = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.time() + timeout_s
    for line in process.stdout:
        lines.append(line)
        if text in line or time.time() > deadline:
            process.send_signal(signal.SIGINT)
            break
    rest, _ = process.communicate(timeout=timeout_s)
    return process.returncode, "".join(lines) + rest


def one_line(output: str, words: str) -> str:
    lines = [line for line in output.splitlines() if words in line]
    assert len(lines) == 1, output[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.long  # make test-long (docs/testing.md): test_first_hour_runs resumes after Ctrl-C
def test_ctrl_c_after_step_3_then_the_same_command_continues_the_run(tmp_path, random_policy_dir, reference):
    command = [*tiny_cli(tmp_path, random_policy_dir, *CELL), f"hydra.run.dir={tmp_path}/run"]
    returncode, output = interrupt_when(command, "3/6 steps")
    assert returncode == 130 and "Traceback" not in output, output[-3000:]
    resume = one_line(output, "run the same command to continue")
    assert "MLflow run" in resume and "marked KILLED" in resume and "src.run" in resume
    mlflow.set_tracking_uri(store(tmp_path))
    killed = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(killed.status) == ["KILLED"]
    assert 3 <= len(MlflowClient(store(tmp_path)).get_metric_history(killed.run_id[0], "train/reward")) < 6

    again = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    log = again.stdout + again.stderr
    assert f"resuming run {killed.run_id[0]}" in log and "RESUME MISMATCH" not in log
    after = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(after.status) == ["FINISHED"] and after.run_id[0] == killed.run_id[0]
    assert_same_metrics_no_duplicates(store(tmp_path), after.run_id[0], reference)


@pytest.mark.slow
def test_ctrl_c_inside_a_multirun_stops_the_sweep_and_finished_cells_stay_finished(tmp_path, random_policy_dir):
    grid = [arg if arg != "buffer=age1" else "buffer=none,age1,age2" for arg in CELL]
    returncode, output = interrupt_when(tiny_cli(tmp_path, random_policy_dir, *grid, multirun=True),
                                        "rho1-L1-c1: 2/6 steps")
    assert returncode == 130 and "Traceback" not in output, output[-3000:]
    one_line(output, "run the same command to continue")
    mlflow.set_tracking_uri(store(tmp_path))
    runs = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert dict(zip(runs["tags.cell"], runs.status)) == {"rho0": "FINISHED", "rho1-L1-c1": "KILLED"}  # no 3rd cell


@pytest.fixture
def run_folder_tmpfs(tmp_path):
    """A small tmpfs for a run folder, grown later by remounting (root only; skipped where not allowed)."""
    folder = tmp_path / "tmpfs"
    folder.mkdir()

    def mount(size: str, *options: str) -> None:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([*options, f"size={size}"]), "tmpfs",
                               str(folder)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")

    yield folder, mount
    subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.slow
def test_a_full_disk_mid_run_is_one_line_and_the_run_resumes_once_space_is_freed(
        tmp_path, random_policy_dir, reference, run_folder_tmpfs):
    folder, mount = run_folder_tmpfs
    size = (Path(reference[0].removeprefix("sqlite:///")).parent / "run" / "checkpoint.pt").stat().st_size
    mount(f"{int(2.3 * size) // 1024 + 64}k")  # two checkpoint generations fit; a third (the temporary) does not
    command = [*tiny_cli(tmp_path, random_policy_dir, *CELL), f"hydra.run.dir={folder}/run"]
    full = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    output = full.stdout + full.stderr
    assert full.returncode == 1 and "Traceback" not in output, output[-3000:]
    line = one_line(output, "no space left")
    assert f"{folder}/run/checkpoint.pt" in line
    amount, unit = re.search(r"needs about ([0-9.]+) (KB|MB) free", line).groups()
    assert 0.8 * size < float(amount) * {"KB": 2**10, "MB": 2**20}[unit] < 1.2 * size  # the checkpoint's size
    mlflow.set_tracking_uri(store(tmp_path))
    failed = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(failed.status) == ["FAILED"] and "no space left" in failed["tags.failure_reason"][0]
    assert not list((folder / "run").glob("*.tmp"))
    assert read_latest_checkpoint(folder / "run")[0]["state"]["step"] == 2

    mount("64m", "remount")  # space freed
    again = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    after = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(after.status) == ["FINISHED"] and after.run_id[0] == failed.run_id[0]
    assert_same_metrics_no_duplicates(store(tmp_path), after.run_id[0], reference)


def test_ctrl_c_in_a_standalone_evaluation_is_one_line_and_130(monkeypatch, capsys):
    from src.eval import standalone

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(standalone, "evaluate_command", interrupted)
    assert standalone.main(["--policy", "x"]) == 130
    assert "stopped by Ctrl-C" in capsys.readouterr().err


def test_an_artifact_that_does_not_fit_names_the_artifact_folder_and_its_size(tmp_path, compose_config, monkeypatch):
    from src.runs import tracking
    from src.runs.artifacts import log_final_policy
    from src.study.labels import run_labels

    cfg = compose_config(f"tracking.uri={store(tmp_path)}", f"tracking.artifact_location={tmp_path}/art")
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "model.safetensors").write_bytes(b"w" * 5000)

    def full(self, run_id, local_dir, artifact_path=None):
        raise OSError(errno.ENOSPC, "No space left on device", f"{tmp_path}/art/x/model.safetensors")

    with pytest.raises(DiskFull) as error:
        with tracking.start_run(RunSettings(cfg).tracking, run_labels(cfg)) as tracker:
            monkeypatch.setattr(MlflowClient, "log_artifacts", full)
            log_final_policy(tracker.run_id, policy, max_artifact_mb=1)
    assert f"{tmp_path}/art/" in str(error.value) and "needs about 4.9 KB free" in str(error.value)
    run = MlflowClient(store(tmp_path)).get_run(tracker.run_id)
    assert run.info.status == "FAILED" and run.data.tags["failure_reason"].startswith("no space left to write")
