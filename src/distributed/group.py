"""Joining the ranks' process group: which collective backend serves which device, and how long a collective waits.

On GPUs the group is `cpu:gloo,cuda:nccl`, not NCCL alone: besides FSDP's CUDA collectives, every step reduces
small CPU tensors (`Ranks.most`, `RankReducer.agree` and `first_row`) and exchanges pickled objects
(`Ranks.share`). A group made with "nccl" maps only `cuda` to a backend (`Backend.backend_capability`, read by
`BackendConfig.__init__` in torch/distributed/distributed_c10d.py), so its first CPU collective raises "No
backend type associated with device type cpu". With one backend per device type, CPU tensors go through gloo,
CUDA tensors through NCCL, and object collectives stay on the CPU (`_get_object_coll_device`, same file).
`device_id` binds the group to this rank's GPU at once, so NCCL never guesses the device from the rank.
"""

from __future__ import annotations

from datetime import timedelta

import torch

# How long a rank waits in a collective before the group aborts. torch's default (10 minutes) is shorter than
# what rank 0 may do while the others wait at a barrier: save a 7B policy (~30 GB) and its optimizer, upload
# it to the tracking store, run a held-out evaluation.
COLLECTIVE_TIMEOUT = timedelta(minutes=60)


def group_options(device: str, local_rank: int = 0) -> dict:
    """`torch.distributed.init_process_group`'s backend, device and timeout for ranks training on `device`."""
    if not str(device).startswith("cuda"):
        return {"backend": "gloo", "timeout": COLLECTIVE_TIMEOUT}
    return {"backend": "cpu:gloo,cuda:nccl", "device_id": torch.device("cuda", local_rank),
            "timeout": COLLECTIVE_TIMEOUT}
