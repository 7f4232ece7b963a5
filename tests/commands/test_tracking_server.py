"""Cluster logging: `make mlflow-server` starts a tracking server behind a password (MLFLOW_AUTH=on, as beyond
the loopback), and a run logs to it over HTTP with the credentials MLflow's client finds in the home folder."""

from __future__ import annotations

import configparser
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from src.paths import PROJECT_ROOT
from tests.ports import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server_folder(tmp_path_factory):
    """The server's store and artifacts, and its user's home (home/), where the credentials file is made."""
    return tmp_path_factory.mktemp("server")


@pytest.fixture(scope="module")
def tracking_server(server_folder):
    tmp_path = server_folder
    port = free_port()
    (tmp_path / "home").mkdir()
    server = subprocess.Popen(["make", "--no-print-directory", "mlflow-server", "MLFLOW_HOST=127.0.0.1",
                               "MLFLOW_AUTH=on",
                               f"MLFLOW_PORT={port}", f"MLFLOW_BACKEND=sqlite:///{tmp_path}/server.db",
                               f"MLFLOW_ARTIFACTS={tmp_path}/server-artifacts",
                               # one worker: what is checked is a run logging over HTTP (test_commands.py stops a
                               # server of two workers); MLflow's four would each import its server
                               "MLFLOW_ARGS=--workers 1"],
                              cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env={**os.environ, "HOME": str(tmp_path / "home")})
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
    os.killpg(server.pid, signal.SIGTERM)  # make and the server it started
    server.wait(timeout=30)


def signed_in(tmp_path) -> dict[str, str]:
    """The credentials `make mlflow-server` made, as MLflow's client reads them (mlflow/utils/credentials.py)."""
    path = tmp_path / "home" / ".mlflow" / "credentials"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(path)
    return dict(parser["mlflow"])


def test_run_logs_to_the_tracking_server_over_http(tmp_path, server_folder, tracking_server, random_policy_dir,
                                                  monkeypatch):
    with pytest.raises(urllib.error.HTTPError) as refused:  # no password: nothing to read
        urllib.request.urlopen(f"{tracking_server}/api/2.0/mlflow/experiments/search?max_results=1", timeout=10)
    assert refused.value.code == 401
    credentials = signed_in(server_folder)
    command = [sys.executable, "-m", "src.run", f"policy.name_or_path={random_policy_dir}", "buffer=age1",
               "clip=tight", "trainer.steps=2", "trainer.groups_per_step=4", "trainer.group_size=2",
               "policy.max_new_tokens=6", "evaluation.at_start=false", "evaluation.prompts=2",
               "evaluation.samples_per_prompt=2", "evaluation.ks=[1]", f"tracking.uri={tracking_server}",
               "tracking.artifact_location=null", "tracking.sweep=server", f"hydra.run.dir={tmp_path}/run"]
    # The run is given nothing: MLflow's client reads the credentials file in its home folder.
    result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "HOME": str(server_folder / "home")})
    assert result.returncode == 0, result.stderr[-3000:]
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", credentials["mlflow_tracking_username"])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", credentials["mlflow_tracking_password"])
    mlflow.set_tracking_uri(tracking_server)
    runs = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(runs["status"]) == ["FINISHED"]
    client = MlflowClient(tracking_server)
    assert "train/reward" in client.get_run(runs.run_id[0]).data.metrics
    assert "config.yaml" in {a.path for a in client.list_artifacts(runs.run_id[0])}  # served by the server
    assert list((server_folder / "server-artifacts").rglob("config.yaml"))
    # The password is in the credentials file alone: not in the run's folder, its logs, its config, the server's
    # store, its artifacts or the auth app's settings and user table (a hash there).
    password = credentials["mlflow_tracking_password"].encode()
    for path in [*tmp_path.rglob("*"), *server_folder.rglob("*")]:
        if path.is_file() and path.name != "credentials":
            assert password not in path.read_bytes(), path
    assert password not in (result.stdout + result.stderr).encode()
    a_colleague_reads_and_logs_once_granted(tracking_server, runs.experiment_id[0], monkeypatch)


def a_colleague_reads_and_logs_once_granted(uri: str, experiment_id: str, monkeypatch) -> None:
    """docs/mlflow.md's steps: the admin (this process's environment) makes a user, who may read every experiment
    and log into the study's once granted EDIT on it."""
    import requests
    from mlflow.server import get_app_client

    get_app_client("basic-auth", tracking_uri=uri).create_user("ada", "her-password")
    ada = ("ada", "her-password")
    search = requests.get(f"{uri}/api/2.0/mlflow/experiments/search", params={"max_results": 5}, auth=ada, timeout=10)
    assert search.status_code == 200 and "replay-rloo" in search.text
    create = {"experiment_id": experiment_id, "run_name": "ada's"}
    assert requests.post(f"{uri}/api/2.0/mlflow/runs/create", json=create, auth=ada, timeout=10).status_code == 403
    grant = {"username": "ada", "resource_type": "experiment", "resource_id": experiment_id, "permission": "EDIT"}
    admin = (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"])
    granted = requests.post(f"{uri}/api/3.0/mlflow/users/permissions/grant", json=grant, auth=admin, timeout=10)
    assert granted.status_code == 200, granted.text
    assert requests.post(f"{uri}/api/2.0/mlflow/runs/create", json=create, auth=ada, timeout=10).status_code == 200


def test_a_run_without_the_password_is_refused_in_one_line(tmp_path, tracking_server, monkeypatch):
    """Before any compute, where MLflow would retry for minutes (src.runs.store_check.check_reachable)."""
    from src.runs.store_check import StoreUnreachable, check_reachable

    monkeypatch.setenv("HOME", str(tmp_path / "nobody"))  # no credentials file
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    with pytest.raises(StoreUnreachable, match="asks for a password, and none was found \\(HTTP 401\\)"):
        check_reachable(tracking_server)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "wrong")
    with pytest.raises(StoreUnreachable, match="refused the password of user 'admin'"):
        check_reachable(tracking_server)
