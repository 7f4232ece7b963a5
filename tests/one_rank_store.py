"""Under `torchrun --nproc_per_node 1`: make a process group over tcp:// as vLLM 0.26's uni-process executor does
(its own host and free port), after `src.runs.ranks.join(1, ...)` (argument `join`) or without it (`none`).
tests/e2e/test_gpu_first_contact.py runs it."""

import datetime
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from src.runs import ranks  # noqa: E402

if sys.argv[1] == "join":
    ranks.join(1, "cpu")
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0,
                        timeout=datetime.timedelta(seconds=5))
print("group made")
dist.destroy_process_group()
