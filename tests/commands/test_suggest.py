"""A near miss on the command line gets one line with "did you mean", a non-zero exit, and no compute."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from src.paths import PROJECT_ROOT
from src.validate.schema import SchemaError
from src.validate.suggest import check_command_line, close_matches

# (the command line after `python -m src.run`, what the one line must say)
NEAR_MISSES = [
    (["clip=tigth"], "clip=tigth: clip has no option 'tigth' (did you mean clip=tight?); its options: loose, mid"),
    (["trainer.step=3"], "trainer.step=3: unknown key (did you mean trainer.steps"),
    (["-m", "clip=tigth,loose"], "clip=tigth,loose: clip has no option 'tigth' (did you mean clip=tight?)"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """The issue's near misses run as a user types them, all at once (each is mostly Python start-up)."""
    folder = tmp_path_factory.mktemp("suggest")
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "COLUMNS": "300"}
    started = time.time()
    procs = [subprocess.Popen([sys.executable, "-m", "src.run", *argv, f"tracking.uri=sqlite:///{folder}/m.db",
                               f"hydra.run.dir={folder}/run", f"hydra.sweep.dir={folder}/multirun"],
                              cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv, _ in NEAR_MISSES]
    results = [proc.communicate(timeout=300) + (proc.returncode,) for proc in procs]
    return {"results": results, "seconds": time.time() - started, "folder": folder}


@pytest.mark.parametrize("index", range(len(NEAR_MISSES)), ids=[" ".join(argv) for argv, _ in NEAR_MISSES])
def test_the_command_suggests_the_close_match_in_one_line(refused, index):
    out, err, status = refused["results"][index]
    expected = NEAR_MISSES[index][1]
    assert status == 2, out + err
    assert out == "" and err.count("\n") == 1 and err.startswith("error: "), out + err
    assert expected in err, err
    assert "Traceback" not in err and "Config search path" not in err


def test_near_misses_are_refused_before_any_compute(refused):
    assert not (refused["folder"] / "m.db").exists()  # no run opened
    assert not (refused["folder"] / "run").exists() and not (refused["folder"] / "multirun").exists()


def test_good_command_lines_pass_untouched():
    check_command_line(["-m", "clip=tight,loose", "buffer.ratio=1", "+sweep=ratio", "trainer.steps=3", "--cfg", "job",
                        "hydra/launcher=submitit_local", "buffer=glob(age*)", "~curriculum", "hydra.run.dir=x"])


@pytest.mark.parametrize("argv, message", [
    (["policy=qwen"], "(did you mean policy=qwen-sft-countdown or policy=qwen2.5-0.5b or policy=qwen2.5-1.5b?)"),
    (["clip=choice(tight,lose)"], "clip=choice(tight,lose): clip has no option 'lose' (did you mean clip=loose?)"),
    (["hydra/launcher=submitit_slrum"], "(did you mean hydra/launcher=submitit_slurm"),
    (["-m", "+sweep=ratoi"], "+sweep=ratoi: sweep has no option 'ratoi' (did you mean +sweep=ratio?)"),
    (["clp=tight"], "clp=tight: there is no config group 'clp' (did you mean clip=...?)"),
    (["buffer=zzz"], "buffer=zzz: buffer has no option 'zzz'; its options: age, age1,"),
])
def test_group_options_are_checked_in_process(argv, message):
    with pytest.raises(SchemaError) as refused:
        check_command_line(argv)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_close_matches_rank_spelling_then_prefix():
    assert close_matches("tigth", ["loose", "mid", "stress", "tight"]) == ["tight"]
    assert close_matches("qwen", ["tiny", "qwen2.5-0.5b"]) == ["qwen2.5-0.5b"]
    assert close_matches("xyz", ["tiny"]) == []


def test_the_budget_suggests_the_option_too(capsys):
    from src.study.budget import main

    with pytest.raises(SystemExit):
        main(["clip=tigth"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(did you mean clip=tight?)" in err, err


def test_the_evaluation_command_suggests_the_option_too(capsys):
    from src.eval.standalone import main

    assert main(["--policy", "checkpoints/tiny-countdown", "clip=tigth"]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert text.count("\n") == 1 and "clip=tigth: clip has no option 'tigth' (did you mean clip=tight?)" in text, text
