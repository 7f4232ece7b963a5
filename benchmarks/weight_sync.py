"""The asynchronous runtime's weight sync on the tiny policy (SPEC 11): publish on Ray's object store, load into a copy.

    python -m benchmarks.weight_sync                # 20 timed rounds after one warm-up
    python -m benchmarks.weight_sync --repeats 50

A publish is what the trainer actor does after an update whose weights the workers load next
(`ObjectStoreSync.publish`: the parameters put in chunks, then the list of chunks); a load is what a
rollout worker does when a request starts with weights it does not hold (`ObjectStoreSync.load`: the
chunks read and copied into its policy). Both run in this process, one torch thread, on a Ray session
of its own. Prints the median and the range of each in milliseconds.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

from benchmarks.async_vs_sync import at_least_one


def rounds(repeats: int) -> tuple[list[float], list[float]]:
    """Milliseconds of each publish and each load, after one untimed round (the session's first put)."""
    import ray
    import torch

    from benchmarks.async_vs_sync import config
    from src.build import build_components
    from src.policy.model import trainer_weights
    from src.runtime.ray_work import ObjectStoreSync, _NoEngine
    from src.settings import RunSettings
    from src.task import countdown

    torch.set_num_threads(1)
    cfg = config(1, 1, 1)
    policy = build_components(RunSettings(cfg), countdown.train_and_heldout(cfg.task)[0]).policy
    worker = copy.deepcopy(policy)
    publish, load = [], []
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for index in range(repeats + 1):
            started = time.perf_counter()
            published = ObjectStoreSync.publish(trainer_weights(policy))
            put = time.perf_counter()
            ObjectStoreSync.load(ray.get(published), worker, _NoEngine())
            if index:
                publish.append(1000 * (put - started))
                load.append(1000 * (time.perf_counter() - put))
    finally:
        ray.shutdown()
    return publish, load


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=at_least_one, default=20, help="timed rounds of a publish and a load")
    args = parser.parse_args(argv)
    publish, load = rounds(args.repeats)
    for name, seconds in (("publish", publish), ("load", load)):
        print(f"{name}: median {statistics.median(seconds):.1f} ms ({min(seconds):.1f}-{max(seconds):.1f} ms) over "
              f"{len(seconds)} rounds")


if __name__ == "__main__":
    main()
