"""Where commands write: the project folder of a clone, the working directory of an installed package.

An installed package is simulated, not installed: src/paths.py and conf/ are copied into a fake
site-packages folder and the config is composed from there in a subprocess whose working directory
is elsewhere (tests/commands/test_first_hour.py builds the real wheel and checks it carries no pyproject.toml,
the file the decision rests on).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from src.paths import PROJECT_ROOT, is_source_checkout, resolve_policy_path, workspace_root


def _tree(base: Path, *files: str) -> Path:
    for name in files:
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).write_text("")
    return base


def test_this_checkout_writes_into_the_project_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_source_checkout(PROJECT_ROOT)
    assert workspace_root() == PROJECT_ROOT  # not the working directory


@pytest.mark.parametrize("layout, checkout", [
    ("clone/replay-rloo", True),
    ("venv/lib/python3.11/site-packages", False),
    ("usr/lib/python3/dist-packages", False),
])
def test_the_workspace_is_the_clone_or_else_the_working_directory(tmp_path, layout, checkout):
    root = _tree(tmp_path / layout, "src/paths.py", "conf/config.yaml", *(["pyproject.toml"] if checkout else []))
    work = tmp_path / "work"
    assert is_source_checkout(root) is checkout
    assert workspace_root(root, cwd=work) == (root if checkout else work)


def test_a_pyproject_inside_site_packages_does_not_make_it_a_clone(tmp_path):
    root = _tree(tmp_path / "venv/lib/python3.12/site-packages", "pyproject.toml", "src/paths.py")
    assert workspace_root(root, cwd=tmp_path / "work") == tmp_path / "work"


def test_a_relative_policy_folder_resolves_in_the_workspace_then_beside_the_code(tmp_path):
    assert resolve_policy_path("checkpoints/tiny-countdown") == str(PROJECT_ROOT / "checkpoints/tiny-countdown")
    assert resolve_policy_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # a hub name stays
    assert resolve_policy_path(str(tmp_path)) == str(tmp_path)


INSTALLED = """
import json, sys
from hydra import compose, initialize_config_dir
import src.paths as paths
paths.register_root_resolver()
with initialize_config_dir(str(paths.CONFIG_DIR), version_base="1.3"):
    cfg = compose("config")
    ziprc = compose("ziprc_main").ziprc
print(json.dumps({"paths": paths.__file__, "out": cfg.out, "uri": cfg.tracking.uri, "artifacts": cfg.tracking.artifact_location,
                  "ziprc": ziprc.workdir,
                  "ziprc_report": ziprc.report_dir, "policy": paths.resolve_policy_path("checkpoints/tiny-countdown")}))
"""


def test_an_installed_package_keeps_its_store_and_outputs_in_the_working_directory(tmp_path):
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (site / "src").mkdir(parents=True)
    (site / "src" / "__init__.py").write_text("")
    shutil.copy(PROJECT_ROOT / "src" / "paths.py", site / "src" / "paths.py")
    shutil.copytree(PROJECT_ROOT / "conf", site / "conf")
    _tree(site, "checkpoints/tiny-countdown/config.json")
    work = tmp_path / "work"
    work.mkdir()
    # PYTHONPATH puts the fake site-packages before this checkout's editable install.
    done = subprocess.run([sys.executable, "-c", INSTALLED], cwd=work, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["paths"] == str(site / "src" / "paths.py")
    assert found["out"] == str(work)
    assert found["uri"] == f"sqlite:///{work}/mlruns.db"
    assert found["artifacts"] == f"{work}/mlartifacts"
    assert found["ziprc"] == f"{work}/outputs/ziprc/tiny" and found["ziprc_report"] == f"{work}/reports/ziprc-tiny"
    assert found["policy"] == str(site / "checkpoints" / "tiny-countdown")  # the shipped warm start is read in place
    assert not list(site.glob("mlruns*")) and not (site / "outputs").exists()
    # Hydra's run and sweep folders derive from `out` too (tests/commands/test_out.py resolves them).
    hydra = OmegaConf.to_container(OmegaConf.load(site / "conf" / "config.yaml").hydra, resolve=False)
    assert hydra["run"]["dir"].startswith("${out}/outputs/") and hydra["sweep"]["dir"].startswith("${out}/outputs/")
