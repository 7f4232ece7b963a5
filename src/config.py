"""Config checks that run before any compute, and the `${root:}` resolver the YAML uses.

Hydra refuses unknown option names (`buffer=age9`) with the list of what exists; `src.schema`
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

import json
import os
import uuid
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from src.passk import ESTIMATORS
from src.paths import register_root_resolver, resolve_policy_path
from src.schema import SchemaError, check_values
from src.policy import DTYPE_NAMES
from src.variant import VARIANT_GROUPS, described, load_target

register_root_resolver()
if not OmegaConf.has_resolver("unique"):
    # Cached like Hydra's ${now:}: one value per composed config, which Hydra copies to every job of a sweep.
    OmegaConf.register_new_resolver("unique", lambda: f"{os.getpid()}-{uuid.uuid4().hex[:6]}", use_cache=True)

ENGINES = ("hf", "vllm")


class ConfigError(ValueError):
    """A configuration that composes but cannot run; the message says how to fix it."""


def validate(cfg: DictConfig, check_device: bool = True) -> None:
    """Raise ConfigError for the first problem found; return quietly for a runnable config.

    `check_device=False` skips the CUDA check: a sweep is planned on a login node without GPUs.
    """
    _check_targets(cfg)  # first: the component classes give their settings' types (`Variant.knobs`)
    _schema(check_values, cfg)  # unknown keys, types and each knob's range: the checks below trust them
    trainer, buffer, evaluation = cfg.trainer, cfg.buffer, cfg.evaluation
    _check(trainer.heartbeat_timeout_s >= 2 * trainer.heartbeat_every_s,
           f"trainer.heartbeat_timeout_s={trainer.heartbeat_timeout_s} < 2 x trainer.heartbeat_every_s="
           f"{trainer.heartbeat_every_s}: a live run would look dead between two heartbeats; raise the timeout")
    _validate_policy_files(cfg.policy.name_or_path)
    fresh_groups = round(trainer.groups_per_step / (1 + buffer.ratio))  # B_fresh, as src.batch.plan_batch
    _check(fresh_groups >= 1,
           f"buffer.ratio rho={buffer.ratio} with trainer.groups_per_step B={trainer.groups_per_step} plans "
           f"B_fresh = round(B / (1 + rho)) = {fresh_groups} fresh groups per step; lower rho or raise B")
    _validate_components(cfg)
    _validate_across_groups(cfg)
    _validate_ranks(cfg)
    if check_device and cfg.hardware.device.startswith("cuda"):
        import torch

        _check(torch.cuda.is_available(),
               f"hardware.device='{cfg.hardware.device}' but no CUDA device is visible here: use hardware=cpu, "
               "or launch on a GPU node (hardware=h100 -m sends the run through SLURM)")
    _check(cfg.policy.engine in ENGINES, f"policy.engine='{cfg.policy.engine}': choose one of {ENGINES}")
    if cfg.policy.engine == "vllm":
        _validate_vllm(cfg.policy.vllm, check_device)
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


def _validate_vllm(options: DictConfig, check_installed: bool) -> None:
    kv_cache = options.get("kv_cache_gib")
    _check(kv_cache is None or kv_cache > 0,
           f"policy.vllm.kv_cache_gib={kv_cache}: the KV cache size in GiB, > 0 (e.g. 1 on CPU), or null")
    if check_installed:  # a login node planning a GPU sweep need not have vLLM
        from src.rollout.vllm_engine import vllm_problem

        problem = vllm_problem(options.allow_untested_version)
        _check(problem is None, str(problem))


POLICY_JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                     "special_tokens_map.json")


def _validate_policy_files(name_or_path: str) -> None:
    """A local policy folder must hold readable files: a damaged one is named here, not by a library traceback."""
    folder = Path(resolve_policy_path(name_or_path))
    fix = ("rebuild it (`make sft-tiny` for the tiny policy), or point policy.name_or_path at an intact folder "
           "(default: checkpoints/tiny-countdown)")
    if not folder.is_dir():
        _check(not str(name_or_path).startswith(("/", ".", "~")),
               f"policy.name_or_path='{name_or_path}': no such folder; {fix}")
        return  # a hub name: from_pretrained resolves it
    _check((folder / "config.json").is_file(),
           f"policy.name_or_path='{name_or_path}': {folder} holds no config.json, so it is not a saved model; {fix}")
    for name in POLICY_JSON_FILES:
        path = folder / name
        if path.is_file():
            try:
                json.loads(path.read_text())
            except (ValueError, OSError) as error:
                raise ConfigError(f"policy.name_or_path='{name_or_path}': {path} is damaged (not valid JSON: "
                                  f"{error}); {fix}") from None
    from safetensors import safe_open

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as weights:
                weights.keys()  # reads and checks the header against the file's size
        except Exception as error:  # noqa: BLE001  (safetensors raises its own error types)
            raise ConfigError(f"policy.name_or_path='{name_or_path}': {path} is damaged "
                              f"({error.__class__.__name__}: {error}); {fix}") from None


def _validate_components(cfg: DictConfig) -> None:
    """Each component checks its own settings in its constructor: build the cheap ones, as a run would.

    Building through `src.build` (the one path the runner uses) rather than re-stating the checks here
    keeps each check in one place, next to the code that relies on it. It imports torch (the loss
    modules need it; `_check_targets` has imported them already), and loads no model.
    """
    from hydra.errors import InstantiationException

    from src.build import check_settings

    try:
        check_settings(cfg)
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
    if ranks == 1:
        return
    key = f"hardware.ranks={ranks}"
    loss = load_target(cfg.loss._target_)
    _check(getattr(loss, "splits_over_ranks", False),
           f"{key} with loss={cfg.loss.name}: its totals do not split over ranks (splits_over_ranks); use loss=rloo, "
           "rloo-tis, asymre, grpo or ipo, or hardware.ranks=1")
    _check(not cfg.trainer.fused_logprobs,
           f"{key} with trainer.fused_logprobs=true: the fused head runs apart from the sharded model; set "
           "trainer.fused_logprobs=false")
    if described(cfg.runtime).plain(cfg.runtime):  # torchrun's ranks; async's trainer actors sit after its workers
        _check(cfg.policy.engine == "hf",
               f"{key} with policy.engine={cfg.policy.engine}: the ranks generate with the sharded policy itself; set "
               "policy.engine=hf")
        _check(cfg.hardware.device in ("cpu", "cuda"),
               f"{key} with hardware.device={cfg.hardware.device}: each rank takes GPU LOCAL_RANK; set "
               "hardware.device=cuda")
    _check(cfg.trainer.groups_per_step >= ranks,
           f"{key} with trainer.groups_per_step={cfg.trainer.groups_per_step}: every rank trains whole groups; "
           f"raise trainer.groups_per_step to at least {ranks}")


def _validate_across_groups(cfg: DictConfig) -> None:
    """Each variant component's own checks across groups (`Variant.check`), in the words of its class."""
    for group in VARIANT_GROUPS:
        node = cfg.get(group)
        try:
            described(node).check(node, cfg)
        except ValueError as error:
            raise ConfigError(str(error)) from None


COMPONENT_GROUPS = (*VARIANT_GROUPS, "task")  # each names its class in `_target_`
BUILT_GROUPS = ("buffer", "loss", "sampling", "behaviour", "curriculum", "task")  # what `check_settings` builds


def _check_targets(cfg: DictConfig) -> None:
    """Every component group's `_target_` names an importable class or function (a store written outside src/ too)."""
    for group in COMPONENT_GROUPS:
        target = cfg[group].get("_target_")
        try:
            load_target(str(target))  # module.Class, or module.Class.method (a classmethod that builds it)
        except Exception as error:  # noqa: BLE001  (no module, no such name, or the module fails to import)
            raise ConfigError(f"{group}._target_={target!r} cannot be imported ({error.__class__.__name__}: {error}); "
                              f"name a class as module.Class on the Python path, or drop the override to use "
                              f"conf/{group}/") from None


def _schema(check, cfg: DictConfig) -> None:
    try:
        check(cfg)
    except SchemaError as error:
        raise ConfigError(str(error)) from None


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
