"""A tracking server that lets in only those with a password: MLflow's basic-auth app (`make mlflow-server`).

MLflow ships the app (`mlflow server --app-name basic-auth`, the `mlflow[auth]` extra): users, permissions per
experiment, HTTP basic credentials. What this module adds is where the secrets live, so that none is ever typed
on a command line or written into a run:

- The admin's name and password are MLflow's own client credentials file, `~/.mlflow/credentials` (section
  `[mlflow]`, keys `mlflow_tracking_username` and `mlflow_tracking_password`; mlflow/utils/credentials.py reads
  it, after `MLFLOW_TRACKING_USERNAME` / `MLFLOW_TRACKING_PASSWORD` from the environment). So every client on a
  machine that shares the home folder (runs, sweeps, SLURM jobs, reports) signs in with nothing to pass on.
  Made on first use with a random password, readable by its owner alone (mode 0600); a file others can read
  is refused.
- The server reads the admin's password and the key that signs its forms from its own environment
  (`MLFLOW_AUTH_ADMIN_PASSWORD`, `MLFLOW_FLASK_SERVER_SECRET_KEY`); the key is kept in the same file, in a
  section of its own that MLflow's client does not read. The app's settings file (`*-auth.ini`, next to the
  store) holds no secret: the user database's address, the admin's name and the permission a signed-in user
  has where none was granted (READ).
"""

from __future__ import annotations

import configparser
import importlib.util
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

SECTION = "mlflow"                    # the section MLflow's client reads
SERVER_SECTION = "replay-rloo-server"  # this project's: the server's signing key
USER_KEY, PASSWORD_KEY, SIGNING_KEY = "mlflow_tracking_username", "mlflow_tracking_password", "flask_secret_key"
ADMIN = "admin"
MODES = ("auto", "on", "off")
DEFAULT_PERMISSION = "READ"  # a signed-in user who was granted nothing may read; without a password, nothing
# How long a worker keeps a password it has checked. MLflow hashes the password of every request with scrypt
# (about 90 ms of CPU here), and a run logs each step's metrics in a request of its own: without the cache an
# authenticated server spent 32 CPU-seconds on the suite's two runs. The cache is MLflow's own (mlflow/server/auth/
# basic_auth.ini, auth_cache_ttl_seconds, off by default): keyed by an HMAC of the password under a per-process
# key, never the password. The cost: a password changed through the API reaches the other workers of a
# multi-worker server up to this many seconds later.
CREDENTIAL_CACHE_SECONDS = 60


class AuthError(RuntimeError):
    """The server cannot start with authentication as asked; the message is the one line to print."""


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str
    signing_key: str
    path: Path


def credentials_path() -> Path:
    """MLflow's client credentials file (mlflow/utils/credentials.py, `_get_credentials_path`)."""
    return Path(os.path.expanduser("~/.mlflow/credentials"))


def client_credentials(environ=os.environ, path: Path | None = None) -> tuple[str, str] | None:
    """The name and password an MLflow client sends, found where MLflow's own client looks (its
    `read_mlflow_creds`: the environment first, then the credentials file); None where neither has both."""
    username, password = environ.get("MLFLOW_TRACKING_USERNAME"), environ.get("MLFLOW_TRACKING_PASSWORD")
    path = credentials_path() if path is None else path
    if not (username and password) and path.is_file():
        parser = configparser.ConfigParser(interpolation=None)
        parser.read(path)
        username = username or parser.get(SECTION, USER_KEY, fallback=None)
        password = password or parser.get(SECTION, PASSWORD_KEY, fallback=None)
    return (username, password) if username and password else None


def wanted(mode: str, loopback: bool) -> bool:
    """Whether the server runs the basic-auth app: `auto` (the default) off this machine only."""
    if mode not in MODES:
        raise AuthError(f"MLFLOW_AUTH={mode}: choose auto (a password whenever the server listens beyond this "
                        "machine), on (always) or off (never: anyone who reaches the port reads and deletes runs)")
    return mode == "on" or (mode == "auto" and not loopback)


def check_installed() -> None:
    """The auth app needs Flask-WTF (the `mlflow[auth]` extra, in the project's dependencies)."""
    if importlib.util.find_spec("flask_wtf") is None:
        raise AuthError("the tracking server's password check (MLflow's basic-auth app) needs Flask-WTF: run make "
                        "install (pip install 'mlflow[auth]'), or MLFLOW_AUTH=off to serve without a password")


def _private(path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthError(f"{path} holds the tracking server's password and others may read it (mode {mode:o}): "
                        f"chmod 600 {path}, and change the password if anyone might have read it")


def load_or_make(path: Path | None = None) -> tuple[Credentials, bool]:
    """The admin's credentials and the signing key from `path` (MLflow's credentials file), made there first
    when missing; True when this call made or completed them."""
    path = credentials_path() if path is None else path
    parser = configparser.ConfigParser(interpolation=None)
    if path.exists():
        _private(path)
        parser.read(path)
    added = False
    for section, key, fresh in ((SECTION, USER_KEY, ADMIN), (SECTION, PASSWORD_KEY, None),
                                (SERVER_SECTION, SIGNING_KEY, None)):
        if not parser.has_section(section):
            parser.add_section(section)
        if not parser.get(section, key, fallback=""):
            parser.set(section, key, fresh or secrets.token_urlsafe(24))
            added = True
    if added:
        _write_private(path, parser)
    return Credentials(parser.get(SECTION, USER_KEY), parser.get(SECTION, PASSWORD_KEY),
                       parser.get(SERVER_SECTION, SIGNING_KEY), path), added


def _write_private(path: Path, parser: configparser.ConfigParser) -> None:
    """Write `parser` to `path` with mode 0600 from the first byte (the folder 0700 when made here)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        parser.write(file)
    os.replace(temporary, path)


def server_settings(credentials: Credentials, folder: Path, stem: str) -> dict[str, str]:
    """Write the auth app's settings file (no secret in it) under `folder`; returns the server's environment."""
    settings = configparser.ConfigParser(interpolation=None)
    settings[SECTION] = {"default_permission": DEFAULT_PERMISSION,
                         "database_uri": f"sqlite:///{(folder / f'{stem}-auth.db').resolve()}",
                         "admin_username": credentials.username,
                         "auth_cache_ttl_seconds": str(CREDENTIAL_CACHE_SECONDS)}
    ini, users = folder / f"{stem}-auth.ini", folder / f"{stem}-auth.db"
    folder.mkdir(parents=True, exist_ok=True)
    os.close(os.open(users, os.O_WRONLY | os.O_CREAT, 0o600))  # the users' password hashes: the owner's alone
    users.chmod(0o600)
    with ini.open("w") as file:
        settings.write(file)
    return {"MLFLOW_AUTH_CONFIG_PATH": str(ini.resolve()), "MLFLOW_AUTH_ADMIN_USERNAME": credentials.username,
            "MLFLOW_AUTH_ADMIN_PASSWORD": credentials.password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": credentials.signing_key}
