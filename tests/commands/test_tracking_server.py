"""Cluster logging: `make mlflow-server` starts a tracking server and a run logs to it over HTTP."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from src.paths import PROJECT_ROOT

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def tracking_server(tmp_path):
    port = free_port()
    server = subprocess.Popen(["make", "--no-print-directory", "mlflow-server", "MLFLOW_HOST=127.0.0.1",
                               f"MLFLOW_PORT={port}", f"MLFLOW_BACKEND=sqlite:///{tmp_path}/server.db",
                               f"MLFLOW_ARTIFACTS={tmp_path}/server-artifacts",
                               # one worker: what is checked is a run logging over HTTP (test_commands.py stops a
                               # server of two workers); MLflow's four would each import its server
                               "MLFLOW_ARGS=--workers 1"],
                              cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2)
            break
        except OSError:
            assert server.poll() is None, server.stdout.read()[-3000:]
            time.sleep(0.5)
    else:
        pytest.fail("the tracking server did not answer within 120 s")
    yield uri
    import os
    import signal

    os.killpg(server.pid, signal.SIGTERM)  # make and the server it started
    server.wait(timeout=30)


def test_run_logs_to_the_tracking_server_over_http(tmp_path, tracking_server, random_policy_dir):
    command = [sys.executable, "-m", "src.run", f"policy.name_or_path={random_policy_dir}", "buffer=age1",
               "clip=tight", "trainer.steps=2", "trainer.groups_per_step=4", "trainer.group_size=2",
               "policy.max_new_tokens=6", "evaluation.at_start=false", "evaluation.prompts=2",
               "evaluation.samples_per_prompt=2", "evaluation.ks=[1]", f"tracking.uri={tracking_server}",
               "tracking.artifact_location=null", "tracking.sweep=server", f"hydra.run.dir={tmp_path}/run"]
    result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    mlflow.set_tracking_uri(tracking_server)
    runs = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(runs["status"]) == ["FINISHED"]
    client = MlflowClient(tracking_server)
    assert "train/reward" in client.get_run(runs.run_id[0]).data.metrics
    assert "config.yaml" in {a.path for a in client.list_artifacts(runs.run_id[0])}  # served by the server
    assert list((tmp_path / "server-artifacts").rglob("config.yaml"))
