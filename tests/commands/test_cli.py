"""`python -m src.run`'s command line as a user types it: -m anywhere, options from Hydra's search path, and each
config mistake refused in one line before torch, transformers and MLflow load (src/command/cli.py)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from src.paths import PROJECT_ROOT
from src.validate.schema import SchemaError
from src.validate.suggest import check_command_line
from tests.commands.test_commands import TINY_RUN

ROOT = PROJECT_ROOT
HEAVY = ("torch", "transformers", "mlflow")
# `python -m src.run`, which names the model libraries it holds as it exits (`-X importtime` would list the
# imports src.variant.described_without_heavy_modules refuses, too).
AS_MAIN = ("-c", "import atexit, runpy, sys; atexit.register(lambda: print('loaded:', *[m for m in "
           f"{HEAVY!r} if m in sys.modules], file=sys.stderr)); runpy.run_module('src.run', run_name='__main__', "
           "alter_sys=True)")
LOADED = "loaded:"
OUTSIDE = ROOT / "tests" / "outside_variants" / "conf"


def src_run(argv: list[str], folder: Path, cwd: Path = ROOT, env: dict | None = None,
            *, entry: tuple[str, ...] = ("-m", "src.run"), timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m src.run ARGV`, its MLflow store and run folders in `folder`."""
    store = [f"tracking.uri=sqlite:///{folder}/m.db", f"tracking.artifact_location={folder}/art",
             f"hydra.run.dir={folder}/run", f"hydra.sweep.dir={folder}/multirun"]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0", "COLUMNS": "400", **(env or {})}
    return subprocess.run([sys.executable, *entry, *argv, *store], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=timeout)


def one_line(done: subprocess.CompletedProcess, *expected: str) -> str:
    """The one error line of a refused command (exit 2, no traceback) holding each of `expected`."""
    error = "\n".join(line for line in done.stderr.splitlines() if not line.startswith(LOADED))
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert error.count("\n") == 0 and error.startswith("error: "), error
    for words in expected:
        assert words in error, error
    return error


# --------------------------------------------------------------------------- options from Hydra's search path
def readme_variant(folder: Path) -> list[str]:
    """The README's "Add a variant" files written under `folder` (each block's first line names its path), and
    the command it shows."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Add a variant", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    for language, body in blocks:
        if language in ("python", "yaml"):
            path = folder / body.splitlines()[0].lstrip("# ").strip()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
    command = next(body for language, body in blocks if language == "bash").strip()
    assert command.startswith("python -m src.run "), command
    return shlex.split(command)[3:]


def test_the_readmes_outside_variant_trains_as_shown(tmp_path):
    argv = readme_variant(tmp_path)
    done = src_run([*argv, *TINY_RUN], tmp_path, cwd=tmp_path)  # from the folder holding my_variants/ and my_conf/
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "newest-rho1-N64" in " ".join(done.stderr.split()) + " ".join(done.stdout.split())
    assert "fresh verifier evaluations" in done.stdout + done.stderr


@pytest.mark.parametrize("searchpath", [
    f"hydra.searchpath=[file://{OUTSIDE}]",                     # absolute
    f"hydra.searchpath=[file://{OUTSIDE.relative_to(ROOT)}]",  # relative to the working directory
    "hydra.searchpath=[pkg://tests.outside_variants.conf]",
])
def test_search_path_options_and_knobs_pass_the_checks_wherever_the_override_stands(searchpath):
    for argv in ([searchpath, "buffer=agecopy", "buffer.max_age=2"], ["buffer=agecopy", "-m", "loss=rloocopy",
                                                                       "buffer.ratio=1", searchpath]):
        check_command_line(argv)
    with pytest.raises(SchemaError) as typo:  # a real typo still gets its close match
        check_command_line(["buffer=agecpy", searchpath])
    assert "(did you mean buffer=agecopy or" in str(typo.value)


# --------------------------------------------------------------------------- -m anywhere
def test_overrides_stand_before_and_after_dash_m(tmp_path):
    done = src_run(["trainer.steps=2", "-m", "buffer=age1,age2", "hydra.sweeper.dry_run=true"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = " ".join((done.stdout + done.stderr).split())
    assert "rho1-L1-c10" in out and "rho1-L2-c10" in out and "trainer.steps=2" in out


def test_a_study_without_dash_m_is_refused_with_the_command_to_type(tmp_path):
    done = src_run(["+sweep=ratio", "hydra.sweeper.dry_run=true"], tmp_path)
    error = one_line(done, "+sweep=ratio", "-m")
    assert "python -m src.run -m +sweep=ratio hydra.sweeper.dry_run=true" in error
    assert not (tmp_path / "m.db").exists() and not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- mistakes, before the model libraries
MISTAKES = [
    (["clip=tigth"], {}, ["(did you mean clip=tight?)"]),
    (["trainer.stepz=3"], {}, ["trainer.stepz=3: unknown key (did you mean trainer.steps"]),
    (["trainer.steps=0"], {}, ["trainer.steps=0: out of range"]),
    (["runtime=async", "runtime.queue=lifo"], {},  # a setting that moved to the buffer group: its new spelling
     ["runtime.queue=lifo: the buffer group holds this setting", "buffer=none (its LIFO pipe)"]),
    (["buffer=age2", "buffer.ratio=-1"], {}, ["buffer.ratio=-1: out of range"]),
    (["buffer=none", "buffer.capacity=512"], {},  # the LIFO queue's bound: runtime=async's alone
     ["buffer.capacity=512: buffer=none reads capacity under runtime=async only", "add runtime=async"]),
    (["buffer=none", "buffer.max_age=2"], {},  # the LIFO queue's age window: runtime=async's alone
     ["buffer.max_age=2: buffer=none reads max_age under runtime=async only", "add runtime=async"]),
    (["runtime=async", "runtime.sharded=true"], {},
     ["runtime.sharded=true: the buffer group holds this setting", "write buffer.sharded=true"]),
    (["loss.eps_low=0.2"], {},
     ["loss.eps_low=0.2: loss=rloo has no setting eps_low", "(loss=grpo, loss=grpo-coupled)"]),
    (["policy.name_or_path=checkpoints/tiny-countdwn"], {},
     ["policy.name_or_path='checkpoints/tiny-countdwn': no such folder", str(ROOT / "checkpoints" / "tiny-countdwn"),
      "(did you mean checkpoints/tiny-countdown?)"]),
    (["policy.name_or_path=Qwen/Qwen2.5-0.5X"], {"HF_ENDPOINT": "http://127.0.0.1:9"},  # nothing listens there
     ["policy.name_or_path='Qwen/Qwen2.5-0.5X': not a folder here", "http://127.0.0.1:9 cannot be reached"]),
    (["policy.name_or_path=Qwen/Qwen2.5-0.5X"], {"HF_HUB_OFFLINE": "1"}, ["HF_HUB_OFFLINE is set"]),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Each mistake as a user types it, all at once (each is mostly Python start-up), naming the model libraries
    it loaded (AS_MAIN); an empty hub cache, so no policy name is found there."""
    folder = tmp_path_factory.mktemp("mistakes")
    runs = []
    for index, (argv, env, _) in enumerate(MISTAKES):
        store = folder / str(index)
        store.mkdir()
        runs.append((store, subprocess.Popen(
            [sys.executable, *AS_MAIN, *argv, f"tracking.uri=sqlite:///{store}/m.db",
             f"hydra.run.dir={store}/run"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400", "HF_HUB_CACHE": str(folder / "hub"),
                 **env})))
    try:
        outputs = [proc.communicate(timeout=300) for _, proc in runs]
        return [(store, subprocess.CompletedProcess(proc.args, proc.returncode, *output))
                for (store, proc), output in zip(runs, outputs)]
    finally:  # a command that trains instead of refusing stops with the test
        for _, proc in runs:
            proc.kill()


@pytest.mark.parametrize("index", range(len(MISTAKES)), ids=[" ".join(argv) for argv, _, _ in MISTAKES])
def test_a_mistake_is_one_line_before_the_model_libraries_load(refused, index):
    store, done = refused[index]
    one_line(done, *MISTAKES[index][2])
    assert f"\n{LOADED}\n" in done.stderr, done.stderr  # none of HEAVY
    assert list(store.iterdir()) == []  # no MLflow store, no run folder


def test_help_loads_no_model_library(tmp_path):
    done = src_run(["--help"], tmp_path, entry=AS_MAIN)
    assert done.returncode == 0 and "Config groups" in done.stdout
    assert done.stderr == f"{LOADED}\n", done.stderr


def test_a_setting_a_torch_component_does_not_use_is_one_line_before_mlflow_opens(tmp_path):
    """A loss class (its module needs torch) is asked once the run imported it, still before any MLflow run."""
    (tmp_path / "conf" / "loss").mkdir(parents=True)
    (tmp_path / "conf" / "loss" / "rlooeps.yaml").write_text(
        "_target_: src.loss.rloo.RlooObjective\nname: rloo\neps_low: 0.2  # set here, not a knob of the class\n")
    done = src_run([f"hydra.searchpath=[file://{tmp_path}/conf]", "loss=rlooeps", "loss.eps_low=0.3"], tmp_path)
    one_line(done, "loss.eps_low=0.3: loss=rlooeps has no knob eps_low", "e.g. loss=grpo")
    assert not (tmp_path / "m.db").exists()


def test_a_buffer_the_async_pipeline_cannot_keep_is_one_line_before_mlflow_opens(tmp_path):
    """Under runtime=async a store keeps rollouts in the form seed 001 gives (buffer=fifo, buffer=none); the age
    buffer has none, so it is refused with the two that run."""
    done = src_run(["runtime=async", "buffer=age1"], tmp_path)
    one_line(done, "buffer=age1 with runtime=async", "use buffer=fifo or buffer=none")
    assert not (tmp_path / "m.db").exists()  # refused by src.command.config.validate, before any MLflow run opens


def async_md_command(*words: str) -> list[str]:
    """The words after `python -m src.run` of the docs/async.md command that holds each of `words`."""
    docs = " ".join((ROOT / "docs" / "async.md").read_text().split())
    return next(command.split("`")[0].split() for command in docs.split("python -m src.run ")[1:]
                if all(word in command.split("`")[0] for word in words))


@pytest.mark.slow  # one async run of trainer=smoke: ~23 s
def test_the_async_fifo_draws_never_drawn_rollouts_first_as_docs_async_types_it(tmp_path):
    """docs/async.md's `buffer.mode=at_least_once` under runtime=async, as typed: it trains (the pipeline's FIFO is
    the one replay core, whose draw has that mode) and finishes its MLflow run."""
    typed = async_md_command("buffer.mode=at_least_once")
    assert typed == ["runtime=async", "buffer=fifo", "buffer.mode=at_least_once", "trainer=smoke"]
    done = src_run(typed, tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gradient steps: 2" in done.stdout + done.stderr


@pytest.mark.slow  # a Hydra sweep composes in a subprocess: ~10 s
def test_an_async_cell_over_two_nodes_plans_one_task_a_node_as_docs_async_types_it(tmp_path):
    """docs/async.md's dry run of an async cell with 4 trainer ranks over 2 nodes: SLURM is asked for 1 task a
    node (the trainer ranks are Ray actors), not ranks / nodes."""
    typed = async_md_command("hardware.nodes=2", "hydra.sweeper.dry_run=true")
    done = src_run(typed, tmp_path)
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 0, said[-3000:]
    assert "each asks for 2 nodes x 1 task, 16 GPUs in all, 64 CPUs and 512 GB a node" in said
