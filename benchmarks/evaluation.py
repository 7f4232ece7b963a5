"""Wall time of an evaluation protocol on a saved policy (`make bench-eval`).

    python -m benchmarks.evaluation                                   # tiny policy, canonical protocol
    python -m benchmarks.evaluation evaluation=probe                  # the best-of-N probe
    python -m benchmarks.evaluation policy.name_or_path=outputs/.../policy

Prints load time, time per repeat, samples per second and the total; the target for the tiny
policy on the canonical protocol (50 prompts x 16 samples x 5 repeats) is 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import time

from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

import src.command.config  # noqa: F401  (the ${root:} resolver)
from src.eval.standalone import evaluate_policy, load_for_evaluation
from src.paths import CONFIG_DIR
from src.task.base import build_task
from src.settings import RunSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (default: evaluation=canonical)")
    args = parser.parse_args()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["evaluation=canonical", *args.overrides])
    src.command.config.validate(cfg)

    started = time.perf_counter()
    task = build_task(cfg.task)
    heldout = task.heldout()
    policy, tokenizer, engine = load_for_evaluation(cfg, cfg.policy.name_or_path, None)
    loaded = time.perf_counter()
    repeat_ends: list[float] = []
    result = evaluate_policy(RunSettings(cfg), policy, tokenizer, engine, heldout, task=task,
                             on_repeat=lambda _: repeat_ends.append(time.perf_counter()))
    finished = time.perf_counter()

    evaluation = cfg.evaluation
    samples = evaluation.prompts * evaluation.samples_per_prompt
    repeat_seconds = [end - start for start, end in zip([loaded, *repeat_ends[:-1]], repeat_ends)]
    table = Table(title=f"{evaluation.name} evaluation of {cfg.policy.name_or_path} "
                        f"({evaluation.prompts} prompts x {evaluation.samples_per_prompt} samples x "
                        f"{evaluation.repeats} repeats)")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    table.add_row("data + model load", f"{loaded - started:.1f}")
    for index, seconds in enumerate(repeat_seconds):
        table.add_row(f"repeat {index} ({samples / seconds:.0f} samples/s)", f"{seconds:.1f}")
    table.add_row("[bold]total", f"[bold]{finished - started:.1f}")
    console = Console()
    console.print(table)
    console.print(f"pass@1 {result.summary['pass@1']:.3f}  mean reward {result.summary['mean_reward']:.3f}  "
                  f"correction rate {result.summary['correction_rate']:.3f}")


if __name__ == "__main__":
    main()
