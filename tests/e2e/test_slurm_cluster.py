"""The local SLURM cluster (launch/local_slurm.sh, two nodes of this machine) runs real jobs.

Needs root; installs slurm-wlm + munge with apt-get on first use (about 10-60 s), then the
cluster starts in a couple of seconds and a trivial job takes about a second.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import LocalSlurm, slurm_cluster, slurm_env  # noqa: F401

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

JOB_TIMEOUT_S = 120


def _wait_for(job_done, what: str, timeout: float = JOB_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not job_done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not finished after {timeout:.0f}s")
        time.sleep(0.2)


def test_submitit_job_runs_on_local_cluster(slurm_env: LocalSlurm, tmp_path: Path):
    submitit = pytest.importorskip("submitit")

    # Defined here, so cloudpickle ships it by value: the job need not import this test module.
    def double(x: int) -> tuple[int, str, str | None]:
        import os
        import sys

        return 2 * x, sys.executable, os.environ.get("SLURM_JOB_ID")

    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(slurm_partition=slurm_env.partition, timeout_min=5, cpus_per_task=1)
    job = executor.submit(double, 21)
    try:
        _wait_for(job.done, f"submitit job {job.job_id}")
    except AssertionError:
        slurm_env.run("scancel", str(job.job_id))
        raise
    value, executable, slurm_job_id = job.result()

    assert value == 42
    assert slurm_job_id == str(job.job_id)  # it really ran under SLURM, not locally
    assert executable == sys.executable  # the job ran this virtualenv's interpreter


def test_sbatch_wrap_completes(slurm_cluster: LocalSlurm, tmp_path: Path):
    out = tmp_path / "job-%j.out"
    submitted = slurm_cluster.run(
        "sbatch",
        "--parsable",
        f"--partition={slurm_cluster.partition}",
        "--time=5",
        "--cpus-per-task=1",
        f"--output={out}",
        f"--chdir={tmp_path}",
        "--wrap",
        f"{sys.executable} -c 'import sys; print(\"hello from\", sys.executable)'",
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    assert job_id.isdigit(), submitted.stdout

    # No accounting (sacct) on this cluster: squeue lists the job while it is pending/running,
    # and scontrol keeps the finished record for MinJobAge (300 s).
    def finished() -> bool:
        queued = slurm_cluster.run("squeue", "-h", "-j", job_id, "-t", "PD,R,CG", "-o", "%T")
        return queued.returncode == 0 and not queued.stdout.strip()

    _wait_for(finished, f"sbatch job {job_id}")
    shown = slurm_cluster.run("scontrol", "show", "job", job_id)
    assert shown.returncode == 0, shown.stderr
    assert "JobState=COMPLETED" in shown.stdout, shown.stdout
    assert "ExitCode=0:0" in shown.stdout, shown.stdout
    log = tmp_path / f"job-{job_id}.out"
    assert log.read_text().strip() == f"hello from {sys.executable}"


def test_a_node_count_that_is_no_whole_number_is_refused_in_one_line(tmp_path: Path):
    import os
    import subprocess

    from tests.slurm_cluster import SCRIPT

    done = subprocess.run(["bash", str(SCRIPT), "status", str(tmp_path)], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "LOCAL_SLURM_NODES": "two"})
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "local_slurm: LOCAL_SLURM_NODES=two: give a whole number >= 1 (e.g. 2)"]
