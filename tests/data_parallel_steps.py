"""A few training steps of the tiny policy, in one process or over torchrun's ranks:

    python tests/data_parallel_steps.py OUT STEPS [OVERRIDES...]
    torchrun --nproc_per_node 2 tests/data_parallel_steps.py OUT STEPS [OVERRIDES...]

Every rank runs the whole step (collect, then learn with its share of the batch); rank 0 writes each
step's metrics to OUT as JSON.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from src.settings import RunSettings
import src.command.config  # noqa: E402,F401  (registers the ${root:} resolver)
from src.build import build_components, data_parallel  # noqa: E402
from src.distributed.data_parallel import leave_group  # noqa: E402
from src.paths import CONFIG_DIR  # noqa: E402
from src.batch import TrainState  # noqa: E402
from src.task import countdown  # noqa: E402
from src.train import train_step  # noqa: E402


def main(out: str, steps: int, overrides: list[str]) -> None:
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1:
        dist.init_process_group("gloo")
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    parts = build_components(RunSettings(cfg), countdown.generate_instances(64, seed=1))
    if ranks > 1:
        parts = data_parallel(parts)
    state = TrainState()
    history = [train_step(parts, state) for _ in range(steps)]
    if ranks == 1 or dist.get_rank() == 0:
        Path(out).write_text(json.dumps(history))
    if ranks > 1:
        leave_group()


if __name__ == "__main__":
    faulthandler.enable()  # an abort (SIGABRT) in a rank prints where each thread was
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
