"""Run under torchrun with the real vLLM (CPU build, gloo): every rank's engine samples its block of calls whose
blocks are uneven or empty, and every rank must get the whole call back, as one engine samples it.

    python -m torch.distributed.run --standalone --nproc_per_node 4 tests/vllm_rank_blocks.py TP OUT

Calls of 2, 5 and 1 prompts over 4 engines leave ranks with nothing to sample: with vLLM's own data parallelism
the engines stepped in lockstep and the others waited for ever on the empty rank. Writes OUT/rank-R.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from src.distributed.generation import RankShare  # noqa: E402
from src.distributed.group import group_options  # noqa: E402
from src.policy.model import load_policy  # noqa: E402
from src.rollout.engine import build_engine  # noqa: E402
from src.rollout.interface import SamplingParams  # noqa: E402
from src.task import countdown  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-countdown"
CALLS = (2, 5, 1)
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=16)


def main(tp: int, out: Path) -> None:
    dist.init_process_group(**group_options("cpu"))
    model, tokenizer = load_policy(str(TINY), "cpu", "float32")
    engine = build_engine("vllm", model, tokenizer, batch_size=8, dtype="float32", enforce_eager=True,
                          kv_cache_gib=0.05, tensor_parallel_size=tp, max_new_tokens=SAMPLING.max_new_tokens)
    shared = RankShare(engine)
    prompts = [countdown.format_prompt(instance) for instance in countdown.generate_instances(max(CALLS), seed=4)]
    calls = []
    for seed, count in enumerate(CALLS):
        whole = shared.generate(prompts[:count], 2, SAMPLING, seed=seed)
        calls.append([[list(done.token_ids) for done in group] for group in whole.completions])
    alone = []  # this rank's engine sampling each whole call by itself: what one process would sample
    for seed, count in enumerate(CALLS):
        whole = engine.generate(prompts[:count], 2, SAMPLING, seed=seed)
        alone.append([[list(done.token_ids) for done in group] for group in whole.completions])
    rank = dist.get_rank()
    (out / f"rank-{rank}.json").write_text(json.dumps({"calls": calls, "alone": alone, "sampled": engine.generated}))
    dist.barrier()
    from src.distributed.data_parallel import leave_group

    leave_group(finished=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
