"""ZIP-RC-Lite, one command per stage, each an MLflow run (experiment `ziprc`, tag `ziprc.stage`):

    python -m src.ziprc collect   # sample rollouts from the frozen policy: training prompts x 4, held-out x 64
    python -m src.ziprc label     # the verifier's reward and reason for each rollout
    python -m src.ziprc train     # head-only training on the reserved slice (backbone frozen)
    python -m src.ziprc score     # offline calibration at K = 64 (Table 3), selection (Table 5), adaptive-K
    python -m src.ziprc decode    # live adaptive decoding: every meta-policy x seed, on tuning and reported prompts
    python -m src.ziprc report    # Table 3/4, the accuracy-vs-compute frontier against best-of-N, Pareto figures
    python -m src.ziprc all       # every stage in order

Trailing arguments are Hydra overrides of `conf/ziprc_main.yaml` (`ziprc=qwen policy=qwen-sft-countdown
hardware=h100` for the paper's setting; `policy.name_or_path=<folder>` for any saved policy). Stages hand
their data on through `ziprc.workdir` (JSON lines and safetensors; nothing is unpickled).
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

import mlflow
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from src.passk import unbiased_pass_at_k
from src.paths import out_problem
from src.runs.naming import flat_params
from src.runs.store import ensure_experiment
from src.runs.tracking import finite
from src.task.base import Task, build_task
from src.ziprc import data, metrics
from src.ziprc.decode import EARLY_STOP_ANSWERS, META_POLICIES, VALUE_SOURCES, MetaPolicy, decode_all
from src.ziprc.head import ReservedSliceHead, make_spec, value_and_length

STAGES = ("collect", "label", "train", "score", "decode", "report")
console = Console(stderr=True)


class ZipRCConfigError(ValueError):
    """A ziprc setting that cannot work: the message names the key, the value and the fix."""


def validate(cfg: DictConfig) -> None:
    """Check the ziprc keys and `out` before any model is loaded (the rest of the config is the runner's)."""
    problem = out_problem(str(cfg.out))
    if problem:
        raise ZipRCConfigError(problem)
    z = cfg.ziprc
    try:
        make_spec(0, z.reserved_start if z.reserved_start is not None else 0, z.verifier, z.length_edges)
    except ValueError as error:
        raise ZipRCConfigError(str(error)) from None
    for key in ("train_prompts", "train_samples", "calibration_prompts", "calibration_samples"):
        if int(z.collect[key]) < 1:
            raise ZipRCConfigError(f"ziprc.collect.{key}={z.collect[key]}: use an integer >= 1")
    if z.score.selection_k > z.collect.calibration_samples:
        raise ZipRCConfigError(f"ziprc.score.selection_k={z.score.selection_k} exceeds "
                               f"ziprc.collect.calibration_samples={z.collect.calibration_samples}: lower it")
    d = z.decode
    if d.k < 1 or d.k_min < 1 or d.k_min > d.k:
        raise ZipRCConfigError(f"ziprc.decode.k={d.k}, k_min={d.k_min}: need 1 <= k_min <= k")
    if d.tune_prompts < 0:
        raise ZipRCConfigError(f"ziprc.decode.tune_prompts={d.tune_prompts}: use 0 (no tuning split) or more")
    if d.early_stop_answer not in EARLY_STOP_ANSWERS:
        raise ZipRCConfigError(f"ziprc.decode.early_stop_answer={d.early_stop_answer}: choose one of "
                               f"{', '.join(EARLY_STOP_ANSWERS)}")
    for entry in d.policies:
        _validate_entry(entry)


ENTRY_KEYS = ("kind", "tau", "beta", "gamma", "threshold", "values", "answer")


def _validate_entry(entry: DictConfig) -> None:
    """One `ziprc.decode.policies` entry: a known kind, its knob in range, no unknown key."""
    def refuse(fix: str):
        raise ZipRCConfigError(f"ziprc.decode.policies entry {dict(entry)}: {fix}")

    if entry.get("kind") not in META_POLICIES:
        refuse(f"kind must be one of {', '.join(META_POLICIES)}")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        refuse(f"unknown key(s) {', '.join(unknown)}; an entry takes {', '.join(ENTRY_KEYS)}")
    if entry.kind == "early_stop" and not 0 < entry.get("tau", 0) <= 1:
        refuse("early_stop needs 0 < tau <= 1")
    if entry.kind == "utility" and not entry.get("beta", -1) >= 0:
        refuse("utility needs beta >= 0")
    threshold = entry.get("threshold", 0.5)
    if threshold is not None and not 0 < threshold <= 1:
        refuse("prune's threshold is a V-hat level in (0, 1], or null to always prune down to k_min")
    if entry.get("values", "head") not in VALUE_SOURCES:
        refuse(f"values must be one of {', '.join(VALUE_SOURCES)} (random: the random-V-hat control)")
    if entry.get("answer", EARLY_STOP_ANSWERS[0]) not in EARLY_STOP_ANSWERS:
        refuse(f"answer must be one of {', '.join(EARLY_STOP_ANSWERS)}")


def meta_policy(cfg: DictConfig, entry: DictConfig) -> MetaPolicy:
    d = cfg.ziprc.decode
    return MetaPolicy(kind=entry.kind, warmup=d.warmup, interval=d.interval, k_min=d.k_min, window=d.window,
                      tau=float(entry.get("tau", 0.8)), beta=float(entry.get("beta", 0.0)),
                      gamma=float(entry.get("gamma", d.gamma)), max_length=cfg.policy.max_new_tokens,
                      threshold=entry.get("threshold", 0.5), values=entry.get("values", "head"),
                      answer=entry.get("answer", d.early_stop_answer))


def policy_label(entry: DictConfig, early_stop_answer: str = EARLY_STOP_ANSWERS[0]) -> str:
    """'none', 'prune', 'prune V<0.2', 'always-prune', 'early_stop tau=0.8', 'utility beta=0.02', with
    ' (random V-hat)' for the control and the early-stop answer when it is not the run's default."""
    if entry.kind == "early_stop":
        label = f"early_stop tau={float(entry.tau):g}"
        answer = entry.get("answer", early_stop_answer)
        label += "" if answer == EARLY_STOP_ANSWERS[0] else f" ({answer})"
    elif entry.kind == "utility":
        label = f"utility beta={float(entry.beta):g}"
    elif entry.kind == "prune":
        threshold = entry.get("threshold", 0.5)
        label = "always-prune" if threshold is None else "prune" if threshold == 0.5 else f"prune V<{threshold:g}"
    else:
        label = entry.kind
    return label + (" (random V-hat)" if entry.get("values", "head") == "random" else "")


def workdir(cfg: DictConfig) -> Path:
    return Path(cfg.ziprc.workdir)


def load_head(cfg: DictConfig, trained: bool):
    """(head on the frozen policy, tokenizer); `trained` loads the slice weights the train stage wrote."""
    from src.policy.model import load_policy

    if cfg.hardware.threads:
        torch.set_num_threads(cfg.hardware.threads)
    policy, tokenizer = load_policy(cfg.policy.name_or_path, cfg.hardware.device, cfg.hardware.dtype)
    policy.eval()
    if trained:
        folder = workdir(cfg) / "head"
        if not (folder / "head.json").is_file():
            raise FileNotFoundError(f"no trained head in {folder}: run `python -m src.ziprc train` first")
        return ReservedSliceHead.load(policy, folder), tokenizer
    vocab = policy.get_output_embeddings().weight.shape[0]
    spec = make_spec(vocab, cfg.ziprc.reserved_start, cfg.ziprc.verifier, cfg.ziprc.length_edges)
    return ReservedSliceHead(policy, spec), tokenizer


def _log_stage(cfg: DictConfig, stage: str):
    experiment_id = ensure_experiment(cfg.tracking.uri, cfg.tracking.experiment, cfg.tracking.artifact_location)
    run = mlflow.start_run(experiment_id=experiment_id, run_name=f"{cfg.ziprc.name}-{stage}",
                           tags={"ziprc.stage": stage, "ziprc.name": cfg.ziprc.name, "policy": cfg.policy.name_or_path,
                                 "ziprc.workdir": str(workdir(cfg)), "sweep": cfg.tracking.sweep})
    mlflow.log_params(flat_params(OmegaConf.create({"ziprc": cfg.ziprc, "policy": cfg.policy})))
    return run


# --------------------------------------------------------------------------- stages


def collect(cfg: DictConfig) -> dict[str, float]:
    """Sample rollouts from the frozen policy (the plain policy: no head is involved)."""
    from src.rollout.interface import SamplingParams
    from src.rollout.engine import build_engine

    c = cfg.ziprc.collect
    _, tokenizer = None, None
    head, tokenizer = load_head(cfg, trained=False)
    engine = build_engine(cfg.policy.engine, head.policy, tokenizer, cfg.policy.generation_batch_size,
                          max_new_tokens=cfg.policy.max_new_tokens, **cfg.policy.get("vllm", {}))
    task = build_task(cfg.task)
    train_set, heldout = task.splits(train_size=c.train_prompts)
    sampling = SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                              max_new_tokens=cfg.policy.max_new_tokens)
    rollouts = []
    for split, instances, samples, seed in (("train", train_set[: c.train_prompts], c.train_samples, c.seed),
                                            ("calibration", heldout[: c.calibration_prompts], c.calibration_samples,
                                             c.seed + 1)):
        prompts = [task.prompt(inst) for inst in instances]
        generation = engine.generate(prompts, samples, sampling, seed)
        for index, (inst, prompt_ids, completions) in enumerate(zip(instances, generation.prompt_ids,
                                                                      generation.completions)):
            rollouts += [data.Rollout(split, index, task.truth(inst), tuple(prompt_ids),
                                      tuple(completion.token_ids), completion.text) for completion in completions]
    count = data.write_rollouts(workdir(cfg) / "rollouts.jsonl", rollouts)
    return {"rollouts": count, "train_rollouts": sum(r.split == "train" for r in rollouts),
            "calibration_rollouts": sum(r.split == "calibration" for r in rollouts)}


def label(cfg: DictConfig) -> dict[str, float]:
    """The verifier's reward and reason for every collected rollout."""
    task = build_task(cfg.task)
    labelled = [data.label(r, task) for r in data.read_rollouts(workdir(cfg) / "rollouts.jsonl")]
    data.write_rollouts(workdir(cfg) / "labelled.jsonl", labelled)
    out = {}
    for split in ("train", "calibration"):
        rewards = [r.reward for r in labelled if r.split == split]
        out[f"{split}/correct_rate"] = sum(r == task.correct_reward for r in rewards) / max(len(rewards), 1)
        out[f"{split}/mean_reward"] = sum(rewards) / max(len(rewards), 1)
    return out


def train(cfg: DictConfig) -> dict[str, float]:
    """Head-only training: per-position cross-entropy on the joint bin, backbone frozen, no KL (Table 7)."""
    t = cfg.ziprc.train
    torch.manual_seed(t.seed)
    head, tokenizer = load_head(cfg, trained=False)
    rollouts = [r for r in data.read_rollouts(workdir(cfg) / "labelled.jsonl") if r.split == "train"]
    if not rollouts:
        raise ValueError(f"no training rollouts in {workdir(cfg) / 'labelled.jsonl'}")
    hidden = data.response_hidden_states(head, rollouts, batch_size=64, pad_id=tokenizer.pad_token_id)
    targets = [data.position_targets(r, head.spec) for r in rollouts]
    features, labels = torch.cat(hidden), torch.cat(targets)
    owner = torch.cat([torch.full((len(h),), i) for i, h in enumerate(hidden)])  # rollout of each position
    optimizer = torch.optim.AdamW(head.slice.parameters(), lr=t.learning_rate, betas=tuple(t.betas),
                                  weight_decay=t.weight_decay)
    steps_per_epoch = math.ceil(len(rollouts) / t.batch_size)
    total = steps_per_epoch * t.epochs
    warmup = max(1, round(t.warmup_ratio * total))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup))))
    order_rng = random.Random(t.seed)
    device = head.slice.weight.device
    losses = []
    for _ in range(t.epochs):
        order = list(range(len(rollouts)))
        order_rng.shuffle(order)
        for start in range(0, len(order), t.batch_size):
            selected = torch.isin(owner, torch.tensor(order[start : start + t.batch_size]))
            logits = head.slice(features[selected].to(device))
            loss = torch.nn.functional.cross_entropy(logits.float(), labels[selected].to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.slice.parameters(), t.grad_clip)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
    head.save(workdir(cfg) / "head")
    mlflow.log_artifacts(str(workdir(cfg) / "head"), "head")
    for step, value in enumerate(losses):
        mlflow.log_metric("train/loss", value, step=step)
    return {"loss_first": losses[0], "loss_last": losses[-1], "optimizer_steps": len(losses),
            "positions": len(labels), "rollouts": len(rollouts)}


@torch.no_grad()
def value_traces(head, tokenizer, rollouts: list[data.Rollout]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Teacher-forced (V-hat per position, joint at the prompt position) for each rollout."""
    hidden = data.response_hidden_states(head, rollouts, batch_size=64, pad_id=tokenizer.pad_token_id)
    values, joints = [], []
    for h in hidden:
        logits = head.slice(h.to(head.slice.weight.device))
        value, _ = value_and_length(logits, head.spec)
        values.append(value.cpu().numpy())
        joints.append(torch.softmax(logits[0].float(), -1).cpu().numpy())
    return values, joints


def score(cfg: DictConfig) -> dict[str, float]:
    """Offline calibration on the held-out K = 64 rollouts (Table 3), selection at K (Table 5), adaptive-K."""
    s, a = cfg.ziprc.score, cfg.ziprc.adaptive_k
    head, tokenizer = load_head(cfg, trained=True)
    rollouts = [r for r in data.read_rollouts(workdir(cfg) / "labelled.jsonl") if r.split == "calibration"]
    values, joints = value_traces(head, tokenizer, rollouts)
    correct_reward = build_task(cfg.task).correct_reward
    correct = np.array([r.reward == correct_reward for r in rollouts])
    ends = np.array([metrics.value_end(v, s.value_end_positions) for v in values])
    f1, accuracy = metrics.f1_and_accuracy(ends >= 0.5, correct)
    by_prompt: dict[int, list[int]] = {}
    for index, r in enumerate(rollouts):
        by_prompt.setdefault(r.prompt_index, []).append(index)
    tvs, prompt_values, value_at_k, random_at_k, oracle_at_k, counts = [], [], [], [], [], []
    for indices in by_prompt.values():
        cells = [data.position_targets(rollouts[i], head.spec)[0].item() for i in indices]  # (state, full-length bin)
        tvs.append(metrics.total_variation(joints[indices[0]], cells))
        prompt_values.append(float(values[indices[0]][0]))  # V-hat(x): the same prompt prefix for all
        first = indices[: s.selection_k]
        value_at_k.append(float(correct[max(first, key=lambda i: ends[i])]))
        random_at_k.append(float(correct[first].mean()))
        oracle_at_k.append(float(correct[first].any()))
        counts.append((len(indices), int(correct[indices].sum())))
    allocation = metrics.adaptive_k(prompt_values, a.mean_k, a.spread)
    adaptive = np.mean([unbiased_pass_at_k(n, c, k) for (n, c), k in zip(counts, allocation)])
    uniform = np.mean([unbiased_pass_at_k(n, c, a.mean_k) for n, c in counts])
    prompt_rates = [c / n for n, c in counts]
    out = {"auc_value_end": metrics.auc(ends, correct), "auc_prompt_value": metrics.auc(
               [values[i][0] for i in range(len(rollouts))], correct),
           "mean_total_variation": float(np.mean(tvs)), "end_f1": f1, "end_accuracy": accuracy,
           "value_at_k": float(np.mean(value_at_k)), "random_at_k": float(np.mean(random_at_k)),
           "oracle_at_k": float(np.mean(oracle_at_k)), "adaptive_k_pass": float(adaptive),
           "uniform_k_pass": float(uniform), "correct_rate": float(correct.mean()), "prompts": len(by_prompt),
           "prompt_value_rank_corr": float(np.corrcoef(metrics.percentile_ranks(prompt_values),
                                                       metrics.percentile_ranks(prompt_rates))[0, 1])}
    figure = calibration_figure(ends, correct, values, workdir(cfg) / "calibration.png")
    mlflow.log_artifact(str(figure))
    (workdir(cfg) / "score.json").write_text(json.dumps(out, indent=2))
    return out


def calibration_figure(ends: np.ndarray, correct: np.ndarray, traces: list[np.ndarray], path: Path) -> Path:
    """Reliability of value_end (binned) and the mean V-hat trace of correct vs failed rollouts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    edges = np.linspace(0, 1, 11)
    which = np.clip(np.digitize(ends, edges) - 1, 0, 9)
    for b in range(10):
        chosen = which == b
        if chosen.any():
            left.scatter(ends[chosen].mean(), correct[chosen].mean(), s=10 + 2 * chosen.sum() ** 0.5, color="C0")
    left.plot([0, 1], [0, 1], "k--", lw=0.8)
    left.set(xlabel="value_end (mean V-hat, last 16 positions)", ylabel="fraction correct", xlim=(0, 1), ylim=(0, 1),
             title="reliability (marker size: rollouts)")
    grid = np.linspace(0, 1, 21)
    for outcome, colour, name in ((True, "C2", "correct"), (False, "C3", "failed")):
        chosen = [np.interp(grid, np.linspace(0, 1, len(t)), t) for t, c in zip(traces, correct) if c == outcome]
        if chosen:
            right.plot(grid, np.mean(chosen, 0), color=colour, label=f"{name} ({len(chosen)})")
    right.set(xlabel="position in the response (fraction)", ylabel="mean V-hat", ylim=(0, 1),
              title="value trace by outcome")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def decode_splits(cfg: DictConfig, tokenizer, task: Task) -> dict[str, tuple[list, list[list[int]]]]:
    """(instances, prompt ids) per split: `report`, the first `decode.prompts` held-out prompts, and `tune`,
    the `decode.tune_prompts` training prompts after those the head trained on, for choosing tau, beta and
    the prune threshold apart from the prompts reported (disjoint from both by construction)."""
    d, c = cfg.ziprc.decode, cfg.ziprc.collect
    train_set, heldout = task.splits(train_size=c.train_prompts + d.tune_prompts)
    splits = {"report": heldout[: d.prompts]}
    if d.tune_prompts:
        splits["tune"] = train_set[c.train_prompts : c.train_prompts + d.tune_prompts]
    return {name: (instances, [list(tokenizer(task.prompt(inst))["input_ids"]) for inst in instances])
            for name, instances in splits.items()}


def decode_once(cfg: DictConfig, head, tokenizer, task: Task, policy: MetaPolicy, instances, prompts,
                seed: int) -> dict:
    """One live decode of `prompts`: accuracy, cost, latency, and for best-of-N the curve over N = 1..K."""
    d = cfg.ziprc.decode
    started = time.perf_counter()
    decoded = decode_all(head, tokenizer, prompts, d.k, policy, seed=seed, temperature=d.temperature,
                         top_p=d.top_p, top_k=d.top_k, max_new_tokens=cfg.policy.max_new_tokens)
    reserved = set(head.spec.ids)
    emitted = sum(token in reserved for item in decoded for ids in item.response_ids for token in ids)
    if emitted:  # the harness invariant of appendix B.5: masking works
        raise RuntimeError(f"the live decoder emitted {emitted} reserved token(s)")
    outcomes = [[task.verify(text, inst).reward == task.correct_reward for text in item.texts]
                for item, inst in zip(decoded, instances)]
    correct = [item.result.selected is not None and right[item.result.selected]
               for item, right in zip(decoded, outcomes)]
    result = {"accuracy": float(np.mean(correct)), "cost": float(np.mean([item.result.cost for item in decoded])),
              "latency": float(np.mean([item.result.latency for item in decoded])),
              "abandoned": float(np.mean([item.result.status.count("abandoned") for item in decoded])),
              "reserved_emitted": float(emitted), "seconds": time.perf_counter() - started}
    if policy.kind == "none":  # every sample finished: best-of-n for each n < K comes from the same samples
        for n in range(1, d.k + 1):
            points = [metrics.best_of_n(item.result.value_ends, right, [len(ids) for ids in item.response_ids], n)
                      for item, right in zip(decoded, outcomes)]
            for name, values in zip(("accuracy", "cost", "latency"), zip(*points)):
                result[f"bon_{name}_n{n}"] = float(np.mean(values))
    return result


def decode(cfg: DictConfig) -> dict[str, float]:
    """Live adaptive decoding: one MLflow run per meta-policy, split (tune, report) and seed."""
    d = cfg.ziprc.decode
    head, tokenizer = load_head(cfg, trained=True)
    task = build_task(cfg.task)
    splits = decode_splits(cfg, tokenizer, task)
    runs = 0
    for entry in d.policies:
        policy, label = meta_policy(cfg, entry), policy_label(entry, d.early_stop_answer)
        for split, (instances, prompts) in splits.items():
            for seed in d.seeds:
                result = decode_once(cfg, head, tokenizer, task, policy, instances, prompts, int(seed))
                tags = {"ziprc.stage": "decode", "ziprc.name": cfg.ziprc.name, "ziprc.workdir": str(workdir(cfg)),
                        "ziprc.policy": label, "ziprc.kind": entry.kind, "ziprc.values": policy.values,
                        "ziprc.split": split, "ziprc.seed": str(seed), "policy": cfg.policy.name_or_path,
                        "sweep": cfg.tracking.sweep}
                with mlflow.start_run(run_name=f"{cfg.ziprc.name}-decode-{label}-{split}-s{seed}", nested=True,
                                      experiment_id=mlflow.active_run().info.experiment_id, tags=tags):
                    mlflow.log_params({"tau": policy.tau, "beta": policy.beta, "gamma": policy.gamma, "k": d.k,
                                       "seed": seed, "warmup": policy.warmup, "interval": policy.interval,
                                       "k_min": policy.k_min, "threshold": policy.threshold,
                                       "answer": policy.answer, "prompts": len(prompts)})
                    mlflow.log_metrics(finite(result))
                console.print(f"{label:<34} {split:<6} seed {seed}: accuracy {result['accuracy']:.3f}  "
                              f"cost {result['cost']:.1f}  latency {result['latency']:.1f}  "
                              f"({result['seconds']:.0f} s)",
                              soft_wrap=True)
                runs += 1
    return {"decode_runs": runs}


def report(cfg: DictConfig) -> dict[str, float]:
    from src.ziprc.report import write_report

    path = write_report(cfg)
    console.print(f"report: {path}")
    mlflow.log_artifact(str(path))
    return {}


STAGE_FUNCTIONS = {"collect": collect, "label": label, "train": train, "score": score, "decode": decode,
                   "report": report}


def run_stage(cfg: DictConfig, stage: str) -> dict[str, float]:
    """Run one stage inside its own MLflow run, logging what it returns as metrics."""
    with _log_stage(cfg, stage):
        out = STAGE_FUNCTIONS[stage](cfg)
        mlflow.log_metrics(finite({key.replace("@", "_at_"): value for key, value in out.items()}))
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    import src.command.config  # noqa: F401  (the ${root:} resolver)
    from hydra import compose, initialize_config_dir

    from src.paths import CONFIG_DIR

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=[*STAGES, "all"])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. ziprc.decode.seeds=[0] ziprc=qwen")
    args = parser.parse_args(argv)
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("ziprc_main", overrides=args.overrides)
    try:
        validate(cfg)
    except ZipRCConfigError as error:
        console.print(f"[red]config error:[/red] {error}")
        return 2
    for stage in STAGES if args.stage == "all" else [args.stage]:
        console.print(f"[bold]ziprc {stage}[/bold] ({cfg.ziprc.name}, {cfg.policy.name_or_path})")
        out = run_stage(cfg, stage)
        for key, value in out.items():
            console.print(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
