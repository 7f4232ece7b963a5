"""One output root: `out` (conf/config.yaml) holds the store, mlartifacts/ and the run and sweep folders,
from any working directory, and every printed command that opens the store names it.

A whole run under `out=DIR` from another folder is tests/commands/test_commands.py's README smoke test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from src.runs import links
from src.paths import out_problem

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0", "COLUMNS": "200"}

# The folders Hydra would make, resolved as src.run resolves them (its resolvers: src.command.config).
RESOLVED = """
import json, sys
import src.command.config  # noqa: F401  (${root:}, ${unique:})
from hydra import compose, initialize_config_dir
from src.paths import CONFIG_DIR
with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
    cfg = compose("config", overrides=sys.argv[1:], return_hydra_config=True)
print(json.dumps({"out": cfg.out, "uri": cfg.tracking.uri, "artifacts": cfg.tracking.artifact_location,
                  "run": cfg.hydra.run.dir, "sweep": cfg.hydra.sweep.dir}))
"""


def _resolved(cwd: Path, *overrides: str) -> dict:
    done = subprocess.run([sys.executable, "-c", RESOLVED, *overrides], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_everything_derives_from_out_whatever_the_working_directory(tmp_path):
    default = _resolved(tmp_path)
    assert default["out"] == str(ROOT)  # the project folder, not the working directory
    assert default["uri"] == f"sqlite:///{ROOT}/mlruns.db" and default["artifacts"] == f"{ROOT}/mlartifacts"
    assert default["run"].startswith(f"{ROOT}/outputs/runs/") and default["sweep"].startswith(f"{ROOT}/outputs/multirun/")
    moved = _resolved(tmp_path, f"out={tmp_path}/o")
    assert moved["uri"] == f"sqlite:///{tmp_path}/o/mlruns.db" and moved["artifacts"] == f"{tmp_path}/o/mlartifacts"
    assert moved["run"].startswith(f"{tmp_path}/o/outputs/runs/")
    assert moved["sweep"].startswith(f"{tmp_path}/o/outputs/multirun/")
    assert list(tmp_path.iterdir()) == []  # composing makes nothing


def test_a_relative_or_unwritable_out_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert out_problem(str(tmp_path / "o")) is None and (tmp_path / "o").is_dir()
    assert out_problem("o2") == f"out=o2: give an absolute folder, e.g. out={tmp_path}/o2 (the store and outputs/ go under it)"
    assert out_problem("/proc/no-such/o").startswith("out=/proc/no-such/o: cannot write there")


def test_the_run_command_refuses_a_relative_out_before_making_anything(tmp_path):
    done = subprocess.run([sys.executable, "-m", "src.run", "out=o", "trainer=smoke"], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.strip() == f"error: out=o: give an absolute folder, e.g. out={tmp_path}/o " \
                                  "(the store and outputs/ go under it)"
    assert list(tmp_path.iterdir()) == []


def test_the_schema_checks_out(compose_config, tmp_path, monkeypatch):
    from src.validate.schema import SchemaError, check_values

    monkeypatch.chdir(tmp_path)
    check_values(compose_config(f"out={tmp_path}/o"))
    with pytest.raises(SchemaError, match="^out=o: give an absolute folder"):
        check_values(compose_config("out=o"))


def test_out_is_not_part_of_the_cell(compose_config, tmp_path):
    from src.study.sweep import cell_identity

    assert cell_identity(compose_config(f"out={tmp_path}")) == cell_identity(compose_config())


@pytest.mark.parametrize("uri, artifacts, out, command", [
    (f"sqlite:///{ROOT}/mlruns.db", f"{ROOT}/mlartifacts", str(ROOT), "make ui"),
    ("sqlite:////x/o/mlruns.db", "/x/o/mlartifacts", "/x/o", "make ui OUT=/x/o"),
    ("sqlite:////x/db.sqlite", "/x/art", str(ROOT), "make ui UI_STORE=sqlite:////x/db.sqlite UI_ARTIFACTS=/x/art"),
    ("sqlite:////x/db.sqlite", None, str(ROOT), "make ui UI_STORE=sqlite:////x/db.sqlite"),
    ("http://login01:5000", None, str(ROOT), None),  # a tracking server serves its own UI
])
def test_the_printed_ui_command_opens_the_store_the_run_used(monkeypatch, uri, artifacts, out, command):
    monkeypatch.chdir(ROOT)
    assert links.ui_command(uri, artifacts, out) == command


def test_outside_the_project_folder_make_is_pointed_at_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert links.ui_command(f"sqlite:///{tmp_path}/mlruns.db", f"{tmp_path}/mlartifacts", str(tmp_path)) == \
        f"make -C {ROOT} ui OUT={tmp_path}"


def test_an_installed_package_names_the_ui_command_itself(monkeypatch):
    monkeypatch.setattr(links, "is_source_checkout", lambda root: False)  # no Makefile beside the code
    assert links.ui_command("sqlite:////x/o/mlruns.db", "/x/o/mlartifacts", "/x/o") == \
        "python -m src.runs.ui_app ui --backend-store-uri sqlite:////x/o/mlruns.db --default-artifact-root " \
        "/x/o/mlartifacts --port 5050"


def test_make_passes_out_to_every_target_that_writes_or_reads_the_store():
    def plan(*words: str) -> str:
        done = subprocess.run(["make", "-n", "-o", ".venv/.installed", *words], cwd=ROOT, capture_output=True,
                              text=True, timeout=60, env={k: v for k, v in ENV.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")})
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "--backend-store-uri sqlite:////x/o/mlruns.db --default-artifact-root /x/o/mlartifacts" in \
        plan("ui", "OUT=/x/o")
    assert f"--backend-store-uri sqlite:///{ROOT}/mlruns.db" in plan("ui")
    demo = plan("demo", "OUT=/x/o").splitlines()
    assert all("out=/x/o" in line for line in demo[:3]) and "--out /x/o/reports/demo" in demo[2], demo
    assert "out=/x/o" in plan("report", "OUT=/x/o") and "out=/x/o" in plan("sweep-ratio", "OUT=/x/o")
    assert "out=" not in plan("demo")  # no OUT: the config's default
