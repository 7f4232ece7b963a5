"""Evaluate saved policies on the held-out protocol (SPEC 7) without retraining, logging into their runs.

The command line, its usage and its checks before torch and MLflow load live in src/eval/command.py
(`python -m src.eval --help`). The task and policy settings come from the evaluated run's own `config.yaml`,
so the held-out prompts are exactly the ones that run trained against; results go to the run through the
MLflow client, so a failed evaluation never changes a finished run's status.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

import mlflow
import torch
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from src.runs import progress
from src.command.config import ConfigError, validate
from src.eval.protocol import EvalResult, evaluate
from src.rollout.interface import SamplingParams
from src.rollout.engine import build_engine
from src.task.base import Task, build_task
from src.runs.store import ensure_experiment
from src.runs.tracking import log_evaluation
from src.task.prompts import PromptFormat
from src.settings import RunSettings
from src.runs.checkpoint import CheckpointError, read_checkpoint
from src.eval.command import argument_parser
from src.command.entry import EntryError, check_policy

log = logging.getLogger(__name__)
console = Console(stderr=True)


def evaluate_policy(run: RunSettings, policy, tokenizer, engine, heldout, on_repeat=None,
                    task: Task | None = None) -> EvalResult:
    """The run's evaluation protocol (its evaluation group) of one policy on the held-out prompts (of `task`,
    by default the one its task group names)."""
    evaluation = run.evaluation
    task = task or build_task(run.groups["task"])
    prompts = PromptFormat(task, tokenizer, run.policy.use_chat_template)
    return evaluate(
        engine, heldout[: evaluation.prompts], prompts.format, task=task, name=evaluation.name,
        samples_per_prompt=evaluation.samples_per_prompt, repeats=evaluation.repeats, ks=list(evaluation.ks),
        estimator=evaluation.estimator,
        sampling=SamplingParams(temperature=evaluation.temperature, top_p=evaluation.top_p,
                                top_k=evaluation.top_k, max_new_tokens=run.policy.max_new_tokens),
        seed=evaluation.seed, on_repeat=on_repeat, samples=run.tracking.completions_per_step,
    )


# --------------------------------------------------------------------------- choosing what to evaluate
def run_config(client: MlflowClient, run_id: str) -> DictConfig:
    """The resolved config a run was trained with (its `config.yaml` artifact)."""
    with tempfile.TemporaryDirectory() as folder:
        path = client.download_artifacts(run_id, "config.yaml", folder)
        return OmegaConf.load(path)


def runs_to_evaluate(client: MlflowClient, experiment: str, run_ids: list[str], sweeps: list[str]) -> list:
    """The MLflow runs named by id, and every FINISHED run of the given studies (shared cells included)."""
    runs = []
    for run_id in run_ids:
        try:
            runs.append(client.get_run(run_id))
        except MlflowException:
            raise SystemExit(f"no MLflow run '{run_id}' at {mlflow.get_tracking_uri()}; "
                             "run ids are listed by `make ui` or `python -m analysis.summary`") from None
    if sweeps:
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise SystemExit(f"no MLflow experiment '{experiment}' at {mlflow.get_tracking_uri()}")
        for sweep in sweeps:  # a cell a study reused from another one carries the study in `sweeps`
            for query in (f"tags.sweep = '{sweep}'", f"tags.sweeps LIKE '%,{sweep},%'"):
                runs += client.search_runs([found.experiment_id],
                                           filter_string=f"{query} and attributes.status = 'FINISHED'",
                                           max_results=10000, order_by=["attributes.start_time ASC"])
    unique = {run.info.run_id: run for run in runs}
    return list(unique.values())


def merged_config(trained: DictConfig, composed: DictConfig) -> DictConfig:
    """The run's task and policy, with the evaluation, hardware and tracking chosen now."""
    cfg = with_components_named(OmegaConf.create(OmegaConf.to_container(trained, resolve=True)), composed)
    for group in ("evaluation", "hardware", "tracking"):
        cfg[group] = composed[group]
    return cfg


def with_components_named(trained: DictConfig, composed: DictConfig) -> DictConfig:
    """A run config as the code reads configs today: every component group present and naming its class.

    A run trained before a group existed ran that group's default (the composed config's); a group saved
    without `_target_` names its option (`name`), whose YAML file gives the class. Reading old configs
    is done here, where a saved config enters, so nothing else asks how old a config is.
    """
    from src.command.config import COMPONENT_GROUPS

    for group in COMPONENT_GROUPS:
        node = trained.get(group)
        if node is None:
            trained[group] = composed[group]
        elif node.get("_target_") is None:
            trained[group]["_target_"] = option_target(group, str(node.get("name") or ""), composed[group])
    return trained


def option_target(group: str, option: str, default: DictConfig) -> str:
    """The `_target_` of conf/<group>/<option>.yaml, through its defaults list; the default option's otherwise."""
    from src.paths import CONFIG_DIR

    path = CONFIG_DIR / group / f"{option}.yaml"
    if not option or not path.is_file():
        return str(default._target_)
    node = OmegaConf.load(path)
    if node.get("_target_") is not None:
        return str(node._target_)
    parents = [entry for entry in node.get("defaults", []) if isinstance(entry, str) and entry != "_self_"]
    return option_target(group, parents[0], default) if parents else str(default._target_)


def stage_of(step: int, total_steps: int) -> str:
    """'final' for the end of training, 'during' for an intermediate checkpoint."""
    return "final" if step >= total_steps else "during"


def load_for_evaluation(cfg: DictConfig, policy_path: str, checkpoint: Path | None):
    """(policy, tokenizer, engine) from a saved folder, optionally overwritten by a training checkpoint's weights."""
    from src.policy.model import load_policy

    if cfg.hardware.threads:
        torch.set_num_threads(cfg.hardware.threads)
    policy, tokenizer = load_policy(policy_path, cfg.hardware.device, cfg.hardware.dtype)
    if checkpoint is not None:
        payload = read_checkpoint(checkpoint, map_location=cfg.hardware.device)  # weights_only: never runs code
        if payload.get("shards"):  # a data-parallel run's checkpoint names its DCP shards
            from src.distributed.checkpoint import load_sharded_policy

            load_sharded_policy(Path(payload["shards"]), policy)
        else:
            policy.load_state_dict(payload["policy"])
    engine = build_engine(cfg.policy.engine, policy, tokenizer, cfg.policy.generation_batch_size,
                         max_new_tokens=cfg.policy.max_new_tokens, **cfg.policy.get("vllm", {}))
    return policy, tokenizer, engine


def evaluate_with_progress(cfg: DictConfig, label: str, policy_path: str, checkpoint: Path | None) -> EvalResult:
    """Load, evaluate with a progress bar over the samples (ETA from the repeats done), and return the result."""
    task = build_task(cfg.task)
    heldout = task.heldout()
    policy, tokenizer, engine = load_for_evaluation(cfg, policy_path, checkpoint)
    with progress.evaluation_progress(f"evaluate {label} ({cfg.evaluation.name})", cfg.evaluation) as on_repeat:
        return evaluate_policy(RunSettings(cfg), policy, tokenizer, engine, heldout, on_repeat=on_repeat, task=task)


def print_result(label: str, result: EvalResult) -> None:
    table = Table(title=f"{label}: {result.name} ({len(result.per_repeat)} repeats)")
    table.add_column("metric")
    table.add_column("mean", justify="right")
    table.add_column("95% half-width", justify="right")
    for key, value in result.summary.items():
        if not key.endswith("_hw"):
            half_width = result.summary.get(f"{key}_hw", float("nan"))
            table.add_row(key, f"{value:.3f}", "-" if half_width != half_width else f"{half_width:.3f}")
    console.print(table)


# --------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    """The command line; Ctrl-C ends it with one line and exit status 130, no traceback."""
    try:
        return evaluate_command(argv)
    except KeyboardInterrupt:
        console.print("stopped by Ctrl-C: the results logged so far stay, and the same command skips them")
        return 130


def evaluate_command(argv: list[str] | None) -> int:
    parser = argument_parser()
    args = parser.parse_args(argv)
    progress.silence_library_bars()
    if not (args.run or args.sweep or args.checkpoint or args.policy):
        parser.error("name what to evaluate: --run RUN_ID, --sweep NAME, --checkpoint PATH or --policy PATH")
    composed = composed_config(args.overrides)
    if composed is None:
        return 2

    if args.policy:
        try:  # the installed command comes here without src/eval/__main__.py's checks
            check_policy(args.policy)
        except EntryError as error:
            console.print(f"[red]error:[/red] {error}", soft_wrap=True, highlight=False)
            return 2
        evaluate_folder(composed, args.policy, args.out or Path(composed.out) / "outputs" / "evaluations")
        if not (args.run or args.sweep or args.checkpoint):
            return 0

    ensure_experiment(composed.tracking.uri, composed.tracking.experiment, composed.tracking.artifact_location)
    client = MlflowClient()
    jobs: list[tuple[str, str, Path | None, int]] = []  # (run id, policy path, checkpoint, step)
    if args.checkpoint:
        job = checkpoint_job(args.checkpoint)
        if job is None:
            return 2
        jobs.append(job)
    jobs += finished_run_jobs(client, composed.tracking.experiment, args.run, args.sweep)
    if args.sweep and not jobs:
        console.print(f"[red]no finished runs[/red] in sweep(s) {', '.join(args.sweep)} of experiment "
                      f"'{composed.tracking.experiment}' at {composed.tracking.uri}")
        return 1
    for run_id, policy_path, checkpoint, step in jobs:
        evaluate_into_run(client, composed, run_id, policy_path, checkpoint, step, force=args.force)
    return 0


def composed_config(overrides: list[str]) -> DictConfig | None:
    """The evaluation, hardware and tracking settings composed and validated, or None after one config error
    line (a bad evaluation setting fails before any model is loaded)."""
    import src.command.config  # noqa: F401  (the ${root:} resolver)
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from src.validate.checks import composition_error
    from src.paths import CONFIG_DIR
    from src.validate.schema import SchemaError
    from src.validate.suggest import check_command_line

    try:
        check_command_line(overrides)  # a near miss (clip=tigth): one line with "did you mean"
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            composed = compose("config", overrides=overrides)
        validate(composed)
    except (ConfigError, SchemaError, HydraException) as error:
        message = composition_error(error, overrides) if isinstance(error, HydraException) else error
        console.print(f"[red]config error:[/red] {message}", soft_wrap=True, highlight=False)
        return None
    return composed


def evaluate_folder(composed: DictConfig, policy: str, out: Path) -> None:
    """--policy: evaluate a saved folder, print the result and write its tables as CSV (no MLflow run)."""
    protocol = composed.evaluation.name
    result = evaluate_with_progress(composed, Path(policy).name, policy, None)
    print_result(policy, result)
    out.mkdir(parents=True, exist_ok=True)
    for table_name, table in (("per_prompt", result.per_prompt), ("per_repeat", result.per_repeat)):
        table.to_csv(out / f"{Path(policy).name}_{protocol}_{table_name}.csv", index=False)
    console.print(f"tables written to {out}")


def checkpoint_job(path: Path) -> tuple[str, None, Path, int] | None:
    """(run id, no policy path, checkpoint, step) of a training checkpoint, or None after one error line."""
    if not path.is_file():
        console.print(f"[red]no checkpoint at {path}[/red]: runs write checkpoint.pt into their "
                      "output folder (the run's `output_dir` tag)")
        return None
    try:
        payload = read_checkpoint(path, map_location="cpu")
    except CheckpointError as error:
        console.print(f"[red]{error}[/red]")
        return None
    return payload["run_id"], None, path, payload["state"]["step"]


def finished_run_jobs(client: MlflowClient, experiment: str, run_ids: list[str],
                      sweeps: list[str]) -> list[tuple[str, str, None, int]]:
    """(run id, saved policy, no checkpoint, final step) of each named run that finished with its policy saved;
    the others are skipped with one line each."""
    jobs = []
    for run in runs_to_evaluate(client, experiment, run_ids, sweeps):
        policy_path = run.data.tags.get("final_policy")
        if run.info.status != "FINISHED" or not policy_path or not Path(policy_path).exists():
            console.print(f"[yellow]skip[/yellow] run {run.info.run_id[:8]} ({run.data.tags.get('cell', '?')}): "
                          f"status {run.info.status}, saved policy {policy_path or 'not recorded'}"
                          + ("" if not policy_path or Path(policy_path).exists() else " is missing"))
            continue
        jobs.append((run.info.run_id, policy_path, None, int(run.data.params.get("trainer.steps", 0))))
    return jobs


def evaluate_into_run(client: MlflowClient, composed: DictConfig, run_id: str, policy_path: str | None,
                      checkpoint: Path | None, step: int, force: bool) -> None:
    """Evaluate one run's policy (or checkpoint) with its own task and policy settings and log the result into
    it, unless the run holds this protocol's results at this step already (and not `force`)."""
    protocol = composed.evaluation.name
    trained = run_config(client, run_id)
    cfg = merged_config(trained, composed)
    stage = stage_of(step, trained.trainer.steps)
    label = f"{run_id[:8]} {client.get_run(run_id).data.tags.get('cell', '')}"
    history = client.get_metric_history(run_id, f"{protocol}/{stage}/mean_reward")
    if any(m.step == step for m in history) and not force:
        console.print(f"[green]done already[/green] {label}: {protocol}/{stage} at step {step} (--force to redo)")
        return
    if policy_path is None:  # a checkpoint: architecture and tokenizer from the run's starting policy
        policy_path = trained.policy.name_or_path
    result = evaluate_with_progress(cfg, label, policy_path, checkpoint)
    log_evaluation(run_id, result, stage, step)
    print_result(label, result)
    console.print(f"logged to MLflow run {run_id} as {protocol}/{stage}/* at step {step}")


if __name__ == "__main__":
    sys.exit(main())
