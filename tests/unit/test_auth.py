"""The tracking server's password (src/runs/auth.py): where the secrets live, who may read them, and when the
server asks for one (`make mlflow-server`, `make ui`: src/runs/serve.py)."""

from __future__ import annotations

import configparser
import os
import stat

import pytest

from src.runs import auth, serve


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("setting, loopback, asks", [
    ("auto", True, False), ("auto", False, True), ("on", True, True), ("on", False, True),
    ("off", True, False), ("off", False, False),
])
def test_a_password_is_asked_beyond_this_machine_unless_turned_off_on_purpose(setting, loopback, asks):
    assert auth.wanted(setting, loopback) is asks


def test_an_unknown_setting_names_the_three():
    with pytest.raises(auth.AuthError, match=r"^MLFLOW_AUTH=yes: choose auto .*, on .* or off"):
        auth.wanted("yes", True)


def test_the_credentials_are_made_once_for_the_owner_alone_in_mlflows_own_file(tmp_path):
    path = tmp_path / "home" / ".mlflow" / "credentials"
    made, fresh = auth.load_or_make(path)
    assert fresh and mode(path) == 0o600 and mode(path.parent) == 0o700
    assert made.username == "admin" and len(made.password) >= 24 and made.signing_key != made.password
    # MLflow's client reads this section and these keys (mlflow/utils/credentials.py, read_mlflow_creds).
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(path)
    assert dict(parser["mlflow"]) == {"mlflow_tracking_username": "admin", "mlflow_tracking_password": made.password}
    again, fresh = auth.load_or_make(path)
    assert again == made and not fresh  # read back, not made again


def test_a_file_with_a_name_and_password_of_its_own_keeps_them_and_gains_a_signing_key(tmp_path):
    path = tmp_path / "credentials"
    path.write_text("[mlflow]\nmlflow_tracking_username = ada\nmlflow_tracking_password = pa%ss\n")
    path.chmod(0o600)
    made, fresh = auth.load_or_make(path)
    assert fresh and (made.username, made.password) == ("ada", "pa%ss") and made.signing_key
    assert mode(path) == 0o600


def test_a_credentials_file_others_can_read_is_refused_in_one_line(tmp_path):
    path = tmp_path / "credentials"
    path.write_text("[mlflow]\nmlflow_tracking_username = admin\nmlflow_tracking_password = x\n")
    path.chmod(0o644)
    with pytest.raises(auth.AuthError, match=rf"^{path} holds .* \(mode 644\): chmod 600 {path}"):
        auth.load_or_make(path)


def test_the_client_takes_the_environment_first_then_the_file(tmp_path):
    path = tmp_path / "credentials"
    assert auth.client_credentials({}, path) is None
    path.write_text("[mlflow]\nmlflow_tracking_username = admin\nmlflow_tracking_password = from-file\n")
    assert auth.client_credentials({}, path) == ("admin", "from-file")
    environ = {"MLFLOW_TRACKING_USERNAME": "ada", "MLFLOW_TRACKING_PASSWORD": "from-env"}
    assert auth.client_credentials(environ, path) == ("ada", "from-env")


def test_the_servers_settings_file_holds_no_secret_and_its_user_table_is_private(tmp_path):
    made, _ = auth.load_or_make(tmp_path / "credentials")
    environ = auth.server_settings(made, tmp_path / "store", "mlflow-server")
    ini = tmp_path / "store" / "mlflow-server-auth.ini"
    assert environ["MLFLOW_AUTH_CONFIG_PATH"] == str(ini) and environ["MLFLOW_AUTH_ADMIN_PASSWORD"] == made.password
    assert environ["MLFLOW_FLASK_SERVER_SECRET_KEY"] == made.signing_key
    text = ini.read_text()
    assert made.password not in text and made.signing_key not in text
    assert f"sqlite:///{tmp_path}/store/mlflow-server-auth.db" in text and "default_permission = READ" in text
    assert mode(tmp_path / "store" / "mlflow-server-auth.db") == 0o600


def test_mlflow_reads_the_settings_file_with_its_credential_cache_on(tmp_path, monkeypatch):
    """Without the cache MLflow hashes the password of every request (scrypt); the file turns it on, as MLflow's
    own reader of the file sees it."""
    from mlflow.server.auth.config import read_auth_config

    made, _ = auth.load_or_make(tmp_path / "credentials")
    environ = auth.server_settings(made, tmp_path / "store", "mlflow-server")
    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", environ["MLFLOW_AUTH_CONFIG_PATH"])
    settings = read_auth_config()
    assert settings.auth_cache_ttl_seconds == auth.CREDENTIAL_CACHE_SECONDS > 0
    assert settings.admin_username == made.username and settings.default_permission == "READ"


def test_the_server_command_gets_the_auth_app_and_its_environment_beyond_the_loopback(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    for key in ("MLFLOW_AUTH_CONFIG_PATH", "MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD",
                "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        monkeypatch.setenv(key, "")  # recorded, so what with_auth sets is undone after the test
    store = f"sqlite:///{tmp_path}/out/mlruns.db"
    assert serve.with_auth(["mlflow", "server"], "auto", "127.0.0.1", store) == (["mlflow", "server"], None)
    command, made = serve.with_auth(["mlflow", "server"], "auto", "0.0.0.0", store)
    assert command == ["mlflow", "server", "--app-name", "basic-auth"]
    assert made.path == tmp_path / ".mlflow" / "credentials" and "made " in capsys.readouterr().out
    assert (tmp_path / "out" / "mlruns-auth.ini").is_file()
    assert os.environ["MLFLOW_AUTH_ADMIN_PASSWORD"] == made.password


def test_make_mlflow_server_without_flask_wtf_or_with_a_bad_setting_is_one_line(monkeypatch, capsys):
    import socket

    with socket.socket() as probe:  # a port free now; nothing listens on it (the server is never started)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(auth.importlib.util, "find_spec", lambda name: None)
    argv = ["--host", "0.0.0.0", "--port", str(port), "--knob", "MLFLOW_PORT", "--target", "mlflow-server"]
    assert serve.main([*argv, "--", "true"]) == 2
    said = capsys.readouterr().err
    assert said.startswith("error: the tracking server's password check") and "MLFLOW_AUTH=off" in said
    assert serve.main([*argv, "--auth", "maybe", "--", "true"]) == 2
    assert capsys.readouterr().err.startswith("error: MLFLOW_AUTH=maybe: choose auto")
