"""Config checks that run before any compute, and the resolvers the YAML uses (`${root:}`, `${mini_batches:}`).

Hydra refuses unknown option names (`buffer=age9`) with the list of what exists; `src.validate.schema`
checks every knob's type and range and refuses unknown keys (`+buffer.ratoi=2`) with the close
matches; each component checks its own group's settings in its constructor, which `validate`
runs by building the cheap components (`src.build.check_settings`); each component class checks
what spans groups for its own settings (`src.variant.Variant.check`: rho <= L for the age buffer,
FIFO capacity against B_replay, a paper recipe's loss and KL, a curriculum against B and K). This
module keeps the checks of the trainer's sizes (B_fresh from B and rho), evaluation ks against
samples and those of groups without a component (policy files, vLLM, device), each with one
message naming the key, the value and the fix.
"""

from __future__ import annotations

import difflib
import json
import os
import uuid
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from src.passk import ESTIMATORS
from src.paths import PROJECT_ROOT, register_root_resolver, resolve_policy_path, workspace_root
from src.validate.schema import SchemaError, check_unused_settings, check_values
from src.policy import DTYPE_NAMES
from src.variant import VARIANT_GROUPS, NeedsHeavyModule, described, load_target
from src.settings import COMPONENT_GROUPS, RunSettings

register_root_resolver()
if not OmegaConf.has_resolver("unique"):
    # Cached like Hydra's ${now:}: one value per composed config, which Hydra copies to every job of a sweep.
    OmegaConf.register_new_resolver("unique", lambda: f"{os.getpid()}-{uuid.uuid4().hex[:6]}", use_cache=True)


class ConfigError(ValueError):
    """A configuration that composes but cannot run; the message says how to fix it."""


def mini_batches(batch: int, mini_batch: int) -> int:
    """`${mini_batches:${trainer.groups_per_step},128}`: optimizer steps per batch for a paper that states its
    mini-batch in prompts (seed 003 line 270: batch 256, mini-batch 128, so 2), kept when the batch changes."""
    if mini_batch < 1 or batch % mini_batch:
        raise ConfigError(f"loss.updates_per_step=${{mini_batches:{batch},{mini_batch}}}: trainer.groups_per_step="
                         f"{batch} is not a whole number of mini-batches of {mini_batch} prompts; set "
                         f"trainer.groups_per_step to a multiple of {mini_batch} or loss.updates_per_step to a number")
    return batch // mini_batch


if not OmegaConf.has_resolver("mini_batches"):
    OmegaConf.register_new_resolver("mini_batches", mini_batches)


def rollouts_in(groups: int, group_size: int) -> int:
    """`${rollouts_in:1024,${trainer.group_size}}`: the rollouts of `groups` groups of K, for a `buffer.capacity` (which
    counts rollouts) that a paper or a default states in groups (seed 002 line 121), kept when K changes."""
    return int(groups) * int(group_size)


if not OmegaConf.has_resolver("rollouts_in"):
    OmegaConf.register_new_resolver("rollouts_in", rollouts_in)


def each_share(total, parts) -> int:
    """`total` split over `parts` (at least 1 each): the launchers' `${per_task:...}` and `${tasks_a_node:...}`."""
    return max(1, int(total) // max(1, int(parts)))


def tasks_a_node(ranks, nodes, runtime) -> int:
    """SLURM tasks on each node of a cell's job: its processes (`Runtime.processes`: one a rank where ranks run the
    loop; under runtime=async one driver, whose trainer ranks are Ray actors, and one task a further node) split
    over its nodes."""
    return each_share(described(runtime).processes(runtime, ranks, nodes), nodes)


# `${per_task:64,${.tasks_per_node}}`: a node's CPUs split over its SLURM tasks.
# `${tasks_a_node:${hardware.ranks},${hardware.nodes},${runtime}}`: the cell's processes split over its nodes (SLURM
# tasks a node); a split that is not even is refused by `_validate_nodes` before anything runs.
for _name, _resolver in (("per_task", each_share), ("tasks_a_node", tasks_a_node)):
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _resolver)

ENGINES = ("hf", "vllm")
HUB_TIMEOUT_S = 10  # the one request that asks the hub whether a policy name exists


def validate(cfg: DictConfig, check_device: bool = True) -> None:
    """Raise ConfigError for the first problem found; return quietly for a runnable config.

    `check_device=False` skips the CUDA check: a sweep is planned on a login node without GPUs.
    """
    _check_targets(cfg)  # first: the component classes give their settings' types (`Variant.knobs`)
    _schema(check_values, cfg)  # unknown keys, types and each knob's range: the checks below trust them
    evaluation = cfg.evaluation
    _check_sizes(cfg)
    validate_policy_files(cfg.policy.name_or_path, check_hub=check_device)
    run = RunSettings(cfg)  # each knob has its type now: the components check their settings from these
    _validate_components(run)
    _validate_across_groups(run)
    _validate_ranks(cfg)
    if check_device and cfg.hardware.device.startswith("cuda"):
        import torch

        _check(torch.cuda.is_available(),
               f"hardware.device='{cfg.hardware.device}' but no CUDA device is visible here: use hardware=cpu, "
               "or launch on a GPU node (hardware=h100 -m sends the run through SLURM)")
    _check(cfg.policy.engine in ENGINES, f"policy.engine='{cfg.policy.engine}': choose one of {ENGINES}")
    if cfg.policy.engine == "vllm":
        _validate_vllm(cfg.policy.vllm, cfg.hardware.device, check_device)
        _validate_tensor_parallel(cfg)
    _check(cfg.hardware.dtype in DTYPE_NAMES, f"hardware.dtype='{cfg.hardware.dtype}': choose one of {DTYPE_NAMES}")
    _check(cfg.hardware.autocast in (None, "bfloat16", "float16"),
           f"hardware.autocast='{cfg.hardware.autocast}': choose null, bfloat16 or float16")
    _check(1 <= evaluation.prompts <= cfg.task.heldout_size,
           f"evaluation.prompts={evaluation.prompts}: must be between 1 and task.heldout_size={cfg.task.heldout_size}")
    _check(evaluation.estimator in ESTIMATORS,
           f"evaluation.estimator='{evaluation.estimator}': choose one of {ESTIMATORS}")
    too_large = [k for k in evaluation.ks if not 1 <= k <= evaluation.samples_per_prompt]
    _check(not too_large,
           f"evaluation.ks has {too_large} outside 1..samples_per_prompt={evaluation.samples_per_prompt}; "
           "drop them or raise evaluation.samples_per_prompt")


def check_settings_take_effect(cfg: DictConfig, overrides: list[str], choices) -> None:
    """A job's command-line settings that its chosen options do not use (`src.validate.schema.check_unused_settings`), with
    every component class loaded: `src.run` checks them for the groups `check_before_imports` could not."""
    from src.paths import searchpath_folders

    _check_targets(cfg)  # the targets `check_before_imports` left to this check: one line for one that names nothing
    roots = tuple(searchpath_folders(overrides))
    _schema(lambda composed: check_unused_settings(composed, overrides, choices, roots=roots), cfg)


def check_before_imports(cfg: DictConfig, overrides: list[str]) -> None:
    """`validate`'s checks that need no model library, for `src.command.cli` to answer before torch, transformers and
    MLflow load: keys, types and ranges (of the groups whose class loads without them), command-line settings the
    chosen option does not use, the trainer's sizes, the policy's files, the tracking store (a server that does not
    answer, a folder that cannot be written) and `trainer.resume_from`. `validate` and the run check them again."""
    from src.paths import searchpath_folders
    from src.runs.lifecycle import CheckpointError, check_resume_from
    from src.runs.store_check import StoreUnreachable, check_store
    from src.variant import described_without_heavy_modules as describe, load_target_without_heavy_modules

    _check_targets(cfg, load_target_without_heavy_modules)  # first: a `_target_` that names nothing, in one line
    _schema(lambda composed: check_values(composed, describe), cfg)
    roots = tuple(searchpath_folders(overrides))
    _schema(lambda composed: check_unused_settings(composed, overrides, cfg.hydra.runtime.choices, describe, roots),
            cfg)
    _check_sizes(cfg)
    validate_policy_files(cfg.policy.name_or_path)
    try:
        check_store(cfg.tracking.uri, cfg.tracking.experiment, cfg.tracking.artifact_location)
        check_resume_from(cfg.trainer.resume_from)
    except (StoreUnreachable, CheckpointError) as error:
        raise ConfigError(str(error)) from None


def _check_sizes(cfg: DictConfig) -> None:
    trainer, buffer = cfg.trainer, cfg.buffer
    _check(trainer.heartbeat_timeout_s >= 2 * trainer.heartbeat_every_s,
           f"trainer.heartbeat_timeout_s={trainer.heartbeat_timeout_s} < 2 x trainer.heartbeat_every_s="
           f"{trainer.heartbeat_every_s}: a live run would look dead between two heartbeats; raise the timeout")
    fresh_groups = round(trainer.groups_per_step / (1 + buffer.ratio))  # B_fresh, as src.batch.plan_batch
    _check(fresh_groups >= 1,
           f"buffer.ratio rho={buffer.ratio} with trainer.groups_per_step B={trainer.groups_per_step} plans "
           f"B_fresh = round(B / (1 + rho)) = {fresh_groups} fresh groups per step; lower rho or raise B")


def _validate_vllm(options: DictConfig, device: str, check_installed: bool) -> None:
    kv_cache = options.get("kv_cache_gib")
    _check(kv_cache is None or kv_cache > 0,
           f"policy.vllm.kv_cache_gib={kv_cache}: the KV cache size in GiB, > 0 (e.g. 1 on CPU), or null")
    _check(not (options.get("sleep") and device == "cpu"),
           "policy.vllm.sleep=true with hardware.device=cpu: vLLM's sleep mode frees GPU memory and runs on CUDA "
           "only; set policy.vllm.sleep=false")
    if check_installed:  # a login node planning a GPU sweep need not have vLLM
        from src.rollout.vllm_engine import vllm_problem

        problem = vllm_problem(options.allow_untested_version)
        _check(problem is None, str(problem))


def _validate_tensor_parallel(cfg: DictConfig) -> None:
    """An engine split over `tp` ranks needs torchrun's ranks in whole engines (`tensor_parallel_options`)."""
    tp, ranks = int(cfg.policy.vllm.get("tensor_parallel_size", 1)), int(cfg.hardware.ranks)
    if tp == 1:
        return
    key = f"policy.vllm.tensor_parallel_size={tp}"
    _check(described(cfg.runtime).ranks_run_the_loop,
           f"{key} with runtime={cfg.runtime.get('name')}: the pipeline's workers each hold a one-GPU engine; set "
           "policy.vllm.tensor_parallel_size=1, or train with runtime=sync over hardware.ranks")
    _check(ranks % tp == 0,
           f"{key} with hardware.ranks={ranks}: each engine takes {tp} of the ranks (one GPU each); set "
           f"hardware.ranks to a multiple of {tp} (torchrun --nproc_per_node), or tensor_parallel_size=1")
    nodes = int(cfg.hardware.get("nodes", 1) or 1)
    _check((ranks // nodes) % tp == 0,
           f"{key} with hardware.ranks={ranks} over hardware.nodes={nodes}: an engine takes {tp} consecutive ranks, "
           f"which must sit on one node of {ranks // nodes}; set tensor_parallel_size to a divisor of {ranks // nodes}")


POLICY_JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                     "special_tokens_map.json")


def validate_policy_files(name_or_path: str, check_hub: bool = True, key: str = "policy.name_or_path") -> None:
    """A local policy folder must hold readable files: a damaged one is named here, not by a library traceback.
    A name that is no folder here is a hub model, which must be in the hub cache or, with `check_hub`, on the
    hub: one request answers that, where transformers would retry for a minute before its traceback."""
    folder = Path(resolve_policy_path(name_or_path))
    shown = f"{key}='{name_or_path}'" if "." in key else f"{key} {name_or_path}"  # a config key or an option
    fix = (f"rebuild it (`make sft-tiny` for the tiny policy), or point {key} at an intact folder "
           "(default: checkpoints/tiny-countdown)")
    if not folder.is_dir():
        _check_missing_folder(str(name_or_path), fix, shown)
        if check_hub:
            _check_hub_model(str(name_or_path), shown)
        return
    _check((folder / "config.json").is_file(),
           f"{shown}: {folder} holds no config.json, so it is not a saved model; {fix}")
    for name in POLICY_JSON_FILES:
        path = folder / name
        if path.is_file():
            try:
                json.loads(path.read_text())
            except (ValueError, OSError) as error:
                raise ConfigError(f"{shown}: {path} is damaged (not valid JSON: "
                                  f"{error}); {fix}") from None
    from safetensors import safe_open

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="numpy") as weights:  # numpy: the header alone needs no torch
                weights.keys()  # reads and checks the header against the file's size
        except Exception as error:  # noqa: BLE001  (safetensors raises its own error types)
            raise ConfigError(f"{shown}: {path} is damaged "
                              f"({error.__class__.__name__}: {error}); {fix}") from None


def _check_missing_folder(name: str, fix: str, shown: str) -> None:
    """Refuse a name that means a folder here (a path, or one under an existing folder such as checkpoints/) but
    names none: the message lists where it looked and the close names beside it."""
    bases = list(dict.fromkeys((workspace_root(), PROJECT_ROOT)))
    first = Path(name).parts[0] if name else ""
    if not (name.startswith(("/", ".", "~")) or name.count("/") > 1 or any((base / first).is_dir() for base in bases)):
        return  # `org/model` or `model`: a hub name
    looked = [Path(name).expanduser()] if name.startswith(("/", "~")) else [base / name for base in bases]
    siblings = sorted({path.name for where in looked if where.parent.is_dir() for path in where.parent.iterdir()
                       if path.is_dir()})
    close = difflib.get_close_matches(Path(name).name, siblings, n=1, cutoff=0.6)
    hint = f" (did you mean {str(Path(name).parent / close[0])}?)" if close else ""
    raise ConfigError(f"{shown}: no such folder, looked for {' and '.join(map(str, looked))}"
                      f"{hint}; {fix}")


def _check_hub_model(name: str, shown: str) -> None:
    """A hub name must be in the local hub cache, or (unless HF_HUB_OFFLINE is set) answer one request to the hub."""
    from huggingface_hub import constants

    if (Path(constants.HF_HUB_CACHE) / f"models--{name.replace('/', '--')}" / "snapshots").is_dir():
        return
    start = (f"{shown}: not a folder here (looked in {workspace_root()}) nor in the hub cache "
             f"({constants.HF_HUB_CACHE})")
    fetch = f"download it where there is network (`hf download {name}`, same HF_HOME), or point the key at a folder"
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{start}, and HF_HUB_OFFLINE is set; {fetch}")
    problem = _hub_problem(name, constants.ENDPOINT)
    if problem:
        raise ConfigError(f"{start}, and {problem}; {fetch}, or fix the name")


def _hub_problem(name: str, endpoint: str) -> str | None:
    """Why the hub cannot serve model `name` (one HEAD request, no retries), or None when it can."""
    import urllib.error
    import urllib.request

    from huggingface_hub import get_token

    token = get_token()
    request = urllib.request.Request(f"{endpoint}/api/models/{name}", method="HEAD",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        urllib.request.urlopen(request, timeout=HUB_TIMEOUT_S).close()
    except urllib.error.HTTPError as error:
        if error.code in (401, 403, 404):
            return f"{endpoint} has no model of that name that this machine may read (HTTP {error.code})"
        return f"{endpoint} answered HTTP {error.code}"
    except (urllib.error.URLError, OSError) as error:
        return f"{endpoint} cannot be reached from here ({getattr(error, 'reason', error)})"
    return None


def _validate_components(run: RunSettings) -> None:
    """Each component checks its own settings in its constructor: build the cheap ones, as a run would.

    Building through `src.build` (the one path the runner uses) rather than re-stating the checks here
    keeps each check in one place, next to the code that relies on it. It imports torch (the loss
    modules need it; `_check_targets` has imported them already), and loads no model.
    """
    from hydra.errors import InstantiationException

    from src.build import check_settings

    try:
        check_settings(run)
    except InstantiationException as error:  # a nested `_target_` node, which Hydra builds and wraps
        raise ConfigError(str(error.__cause__ or error)) from None
    except ValueError as error:  # a bad setting, in the constructor's own words
        raise ConfigError(str(error)) from None
    except TypeError as error:  # a `_target_` override naming a class that takes other settings
        raise ConfigError(f"{error}: a group's `_target_` must name a class that takes that group's settings "
                          "(see conf/<group>/*.yaml); fix the override or drop it") from None


def _validate_ranks(cfg: DictConfig) -> None:
    """What data-parallel training over `hardware.ranks` ranks can run: torchrun's processes under runtime=sync
    (src/runs/ranks.py), the trainer actors under runtime=async (src/runtime/ray_work.py)."""
    ranks = int(cfg.hardware.ranks)
    _validate_nodes(cfg, ranks)
    if cfg.hardware.get("ranked", False):
        _check(ranks == 1, f"hardware.ranked=true with hardware.ranks={ranks}: {ranks} ranks take the ranked path "
                           "already; drop hardware.ranked")
        _check(described(cfg.runtime).ranks_run_the_loop,
               "hardware.ranked=true under a runtime whose ranks are not the loop's processes (runtime=async: its "
               "trainer actors); drop hardware.ranked, or use runtime=sync under torchrun")
    if ranks == 1:
        return
    key = f"hardware.ranks={ranks}"
    _check(not cfg.trainer.compile,
           f"{key} with trainer.compile=true: compiled layers under FSDP have not been tried here; set "
           "trainer.compile=false")
    if described(cfg.runtime).ranks_run_the_loop:  # torchrun's ranks; async's trainer actors sit after its workers
        _check(cfg.hardware.device in ("cpu", "cuda"),
               f"{key} with hardware.device={cfg.hardware.device}: each rank takes GPU LOCAL_RANK; set "
               "hardware.device=cuda")
    _check(cfg.trainer.groups_per_step >= ranks,
           f"{key} with trainer.groups_per_step={cfg.trainer.groups_per_step}: every rank trains whole groups; "
           f"raise trainer.groups_per_step to at least {ranks}")


def _validate_nodes(cfg: DictConfig, ranks: int) -> None:
    """A cell over `hardware.nodes` nodes: the same number of ranks on each where ranks run the loop (SLURM's
    tasks or torchrun's processes meet in one process group); seed 001's pipeline starts a Ray cluster over them."""
    nodes = int(cfg.hardware.get("nodes", 1) or 1)
    if nodes == 1:
        return
    key = f"hardware.nodes={nodes}"
    if not described(cfg.runtime).ranks_run_the_loop:  # one driver: its Ray cluster spans the job's nodes
        _check(cfg.runtime.get("address") is None,
               f"{key} with runtime.address={cfg.runtime.get('address')}: over a SLURM job's nodes the run starts "
               "its own Ray cluster; drop runtime.address, or set hardware.nodes=1 to join that cluster")
        return
    _check(ranks % nodes == 0 and ranks >= nodes,
           f"{key} with hardware.ranks={ranks}: every node runs the same number of ranks (one a GPU); set "
           f"hardware.ranks to a multiple of {nodes} (hardware=h100x8: hardware.ranks={8 * nodes})")


def _validate_across_groups(run: RunSettings) -> None:
    """Each variant component's own checks across groups (`Variant.check`), in the words of its class."""
    for group in VARIANT_GROUPS:
        node = run.groups[group]
        try:
            described(node).check(node, run)
        except ValueError as error:
            raise ConfigError(str(error)) from None


BUILT_GROUPS = ("buffer", "loss", "sampling", "behaviour", "curriculum", "task")  # what `check_settings` builds


def _check_targets(cfg: DictConfig, load=load_target) -> None:
    """Every component group's `_target_` names an importable class or function (a store written outside src/ too);
    `load` may leave a target whose module needs torch or the like to a later check (NeedsHeavyModule)."""
    for group in COMPONENT_GROUPS:
        target = cfg[group].get("_target_")
        try:
            load(str(target))  # module.Class, or module.Class.method (a classmethod that builds it)
        except NeedsHeavyModule:
            continue
        except Exception as error:  # noqa: BLE001  (no module, no such name, or the module fails to import)
            raise ConfigError(f"{group}._target_={target!r} cannot be imported ({error.__class__.__name__}: {error}); "
                              f"name a class as module.Class on the Python path, or drop the override to use "
                              f"conf/{group}/") from None


def _schema(check, cfg: DictConfig) -> None:
    """The first check to resolve the whole config: a resolver's own ConfigError (`${mini_batches:}`), which
    OmegaConf wraps in its InterpolationResolutionError, comes out as itself."""
    try:
        check(cfg)
    except SchemaError as error:
        raise ConfigError(str(error)) from None
    except InterpolationResolutionError as error:
        cause = error
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise ConfigError(str(cause)) from None


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
