"""The benchmark scripts run (smoke runs on tiny settings, so they cannot rot between GPU sessions)."""

from __future__ import annotations

import subprocess
import sys

from src.paths import PROJECT_ROOT


def test_gpu_step_benchmark_smoke_run_on_cpu():
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_step", "--tiny", "--device", "cpu"],
                            cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    step_table = lines[next(i for i, line in enumerate(lines) if line.startswith("| rho |")):]
    rows = [line for line in step_table if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["0", "1", "2"]  # rho = 0, 1, 2
    assert "4/0" in rows[0] and "1/3" in rows[2]  # B_fresh / B_replay at B = 4
    assert any(line.startswith("| 2 | fp32+autocast | dynamic |") for line in lines)  # generate at 2 rows
