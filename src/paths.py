"""Fixed locations, so commands work from any working directory.

Two roots. PROJECT_ROOT is where the code and its data sit (`conf/`, `checkpoints/`): the clone, or
site-packages for a built package. `workspace_root()` is where commands write by default (the config's `out` key,
`out=DIR` moves it): the MLflow store (`mlruns.db`, `mlartifacts/`), `outputs/` and `reports/`. In a clone (an
editable install, or commands run from the folder) it is the project folder, as docs/install.md
describes; for a package installed with `pip install .` it is the working directory, since
site-packages is no place for a user's runs (and is often read-only).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = PROJECT_ROOT / "conf"
INSTALL_FOLDERS = ("site-packages", "dist-packages")  # pip's and Debian's folders for installed packages
CACHE_ENV = "REPLAY_RLOO_CACHE"


def cache_folder() -> Path | None:
    """Where what a run makes once and reuses is kept (src/task/set_cache.py, src/runs/store.py): the folder
    `REPLAY_RLOO_CACHE` names, else the user's cache folder; None when the variable is set empty (no cache)."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen is not None:
        return Path(chosen).expanduser() if chosen.strip() else None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "replay-rloo"


def is_source_checkout(root: Path) -> bool:
    """True for a clone: pyproject.toml sits beside `src/`, outside any site-packages folder.

    A wheel installs `src/`, `conf/` and `checkpoints/` straight into site-packages, without pyproject.toml.
    """
    return (root / "pyproject.toml").is_file() and not set(INSTALL_FOLDERS) & set(Path(root).parts)


def workspace_root(root: Path = PROJECT_ROOT, cwd: Path | None = None) -> Path:
    """Where the default store, outputs/ and reports/ go: the project folder of a clone, else the working directory."""
    return Path(root) if is_source_checkout(Path(root)) else Path(cwd) if cwd is not None else Path.cwd()


def register_root_resolver() -> None:
    """`${root:}` in the YAML: the workspace root, the default of `out`, which the store and folders derive from."""
    if not OmegaConf.has_resolver("root"):
        OmegaConf.register_new_resolver("root", lambda: str(workspace_root()))


def resolve_policy_path(name_or_path: str) -> str:
    """A hub name stays as it is; a relative folder is looked up in the workspace, then beside the code."""
    candidate = Path(name_or_path)
    if candidate.is_absolute():
        return name_or_path
    for base in dict.fromkeys((workspace_root(), PROJECT_ROOT)):
        if (base / candidate).exists():
            return str(base / candidate)
    return name_or_path


def searchpath_folders(overrides: list[str]) -> list[Path]:
    """The folders a command line's `hydra.searchpath=[...]` adds to Hydra's config search path, wherever the
    override stands: `file://` entries relative to the working directory (as Hydra's FileConfigSource joins them,
    hydra/_internal/core_plugins/file_config_source.py:24), `pkg://` entries as the package's folder."""
    import importlib.util

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    words = [word for word in overrides if word.startswith("hydra.searchpath=")]
    try:
        entries = [entry for override in OverridesParser.create().parse_overrides(words)
                   for entry in override.value() if isinstance(entry, str)]
    except (HydraException, TypeError):
        return []  # a malformed value: Hydra's own message names it
    folders = []
    for entry in entries:
        scheme, _, where = entry.partition("://")
        if scheme == "file":
            folders.append(Path(where).expanduser().resolve())
        elif scheme == "pkg":
            try:
                spec = importlib.util.find_spec(where)
            except ImportError:
                spec = None
            folders += [Path(folder) for folder in (spec.submodule_search_locations or [])] if spec else []
    return [folder for folder in folders if folder.is_dir()]


def folder_problem(key: str, folder: str, keep: bool = True) -> str | None:
    """Why `folder` (the value of `key`) cannot hold a job's outputs, or None when it can. The folder is made
    here to try it; `keep=False` removes again what the check made (a sweep makes its folder only when it
    launches, so a dry run leaves none)."""
    made = [path for path in (Path(folder), *Path(folder).parents) if not path.exists()]  # deepest first
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-"):
            pass
    except OSError as error:
        return (f"{key}={folder}: cannot write there ({error.strerror or error}); give {key}= a folder you can "
                "write to (out=DIR moves the store and outputs/ under DIR; the default is the project folder)")
    finally:
        for path in made if not keep else ():
            try:
                path.rmdir()
            except OSError:  # something else wrote there meanwhile: it stays
                break
    return None


def out_problem(folder: str) -> str | None:
    """Why `out` cannot hold the store and outputs/, or None when it can (it is made here).

    Absolute only: the store's artifact folder becomes a file:// URI, which a relative path has none of
    (pathlib's as_uri raises), and every process would read a relative `out` from its own working directory."""
    if not Path(folder).is_absolute():  # `~` too: Hydra passes it on as it is
        return (f"out={folder}: give an absolute folder, e.g. out={Path.cwd() / Path(folder).expanduser()} "
                "(the store and outputs/ go under it)")
    return folder_problem("out", folder)


def project_version() -> str:
    """The installed package's version (its metadata, from pyproject.toml); read without importing the project."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("replay-rloo")
    except PackageNotFoundError:  # a checkout run in place, never installed
        return "(not installed: pip install -e .)"
