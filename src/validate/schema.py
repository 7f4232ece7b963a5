"""The type and range of every knob, checked before anything else, so a typo is one clear message.

Which keys exist comes from the YAML files themselves (the union over every option of every
config group), so a key added to a YAML file is known at once; `KNOBS` gives each numeric knob of
the groups without a component its type and range, and a variant component's class gives its own
settings' (`src.variant.Variant.knobs`, e.g. `buffer.ratio` from the store the buffer group names);
a knob missing from both is typed by its YAML default and only checked to be a finite number. A key that exists nowhere (`+buffer.ratoi=2`) is refused with the close matches.
Hydra parses command-line values (`trainer.steps=abc` is the string 'abc', `1e12` a float), so
every value is checked here, never trusted to be of its default's type.
"""

from __future__ import annotations

import difflib
import math
import functools
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

from src.paths import CONFIG_DIR, out_problem, searchpath_folders
from src.variant import INF, VARIANT_GROUPS, Knob, described
from src.variant import float_knob as _float
from src.variant import int_knob as _int


# libyaml's parser where PyYAML was built with it: the same documents, parsed about ten times faster than the
# pure-Python one (every command line's checks read the whole of conf/).
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def group_defaults(config_dir: Path = CONFIG_DIR) -> dict[str, str]:
    """The option each group takes by default, from config.yaml's defaults list."""
    return dict(_group_defaults(Path(config_dir)))


@functools.lru_cache(maxsize=8)
def _group_defaults(config_dir: Path) -> tuple[tuple[str, str], ...]:
    """Read once per process: a command line's checks ask for every group in turn."""
    defaults = {}
    for entry in yaml.load((config_dir / "config.yaml").read_text(), Loader=SAFE_LOADER)["defaults"]:
        if isinstance(entry, dict):
            for group, option in entry.items():
                if not group.startswith("override "):
                    defaults[group] = str(option)
    return tuple(defaults.items())


SEED = _int(0, 2**32 - 1, "0")
PROBABILITY = _float(0, 1, "0.95", low_open=True)
TEMPERATURE = _float(0, 100, "1.0", low_open=True)

# Numeric knobs of the groups without a component: type and the range the method can run (upper bounds
# refuse sizes that would hang). A variant component's class lists its own (`Variant.knobs`).
KNOBS: dict[str, Knob] = {
    "trainer.steps": _int(1, 100_000, "60 (the paper trains 100 steps)", why="train for at least one step"),
    "trainer.groups_per_step": _int(1, 65_536, "32", why="B: at least one prompt group per step"),
    "trainer.group_size": _int(2, 4_096, "16", why="K: the leave-one-out baseline (eq. 1) needs K >= 2"),
    "trainer.learning_rate": _float(0, 1, "5e-5", low_open=True),
    "trainer.weight_decay": _float(0, 10, "1e-4"),
    "trainer.kl_coef": _float(0, 1e6, "1e-3"),
    "trainer.entropy_coef": _float(-1e6, 1e6, "1e-3"),
    "trainer.max_grad_norm": _float(0, INF, "1.0 or null", low_open=True, nullable=True),
    "trainer.micro_batch_size": _int(1, 1_000_000, "32"),
    "trainer.micro_batch_tokens": _int(1, INF, "65536 or null", nullable=True),
    "trainer.rollout.temperature": TEMPERATURE,
    "trainer.rollout.top_p": PROBABILITY,
    "trainer.rollout.top_k": _int(0, INF, "20 or null", nullable=True),
    "trainer.seed": SEED,
    "trainer.kl_estimator": Knob("text", example="k3 (k1, k2 or k3)", id_omitted_at=("k3",)),
    "trainer.checkpoint_every": _int(0, INF, "10 (0: only at the end)"),
    "trainer.heartbeat_every_s": _float(0, 3600, "10", low_open=True),
    "trainer.heartbeat_timeout_s": _float(0, INF, "120", low_open=True),
    "clip.ceiling": _float(0, 1e6, "1, 3 or 10", low_open=True, why="the importance-weight ceiling c (clip=tight/mid/loose)"),
    "evaluation.prompts": _int(1, 1_000_000, "50"),
    "evaluation.samples_per_prompt": _int(1, 100_000, "8"),
    "evaluation.repeats": _int(1, 1_000, "5"),
    "evaluation.temperature": TEMPERATURE,
    "evaluation.top_p": PROBABILITY,
    "evaluation.top_k": _int(0, INF, "20 or null", nullable=True),
    "evaluation.seed": SEED,
    "evaluation.every": _int(0, INF, "10 (0: only at the start and end)"),
    "policy.generation_batch_size": _int(1, 10_000_000, "512"),
    "policy.max_new_tokens": _int(1, 1_000_000, "52"),
    "policy.vllm.gpu_memory_utilization": _float(0, 1, "0.3", low_open=True, high_open=True,
                                                  why="vLLM's share of the GPU"),
    "policy.vllm.max_model_len": _int(1, INF, "4096 or null", nullable=True),
    "policy.vllm.max_num_seqs": _int(1, INF, "256 or null", nullable=True),
    "policy.vllm.seed": SEED,
    "policy.vllm.tensor_parallel_size": _int(1, 64, "2 (hardware.ranks a multiple of it)"),
    "hardware.threads": _int(1, 4_096, "2 or null", nullable=True),
    "hardware.ranks": _int(1, 1_024, "1, or the GPUs of the job"),
    "hardware.nodes": _int(1, 128, "1, or 2 with hardware.ranks=16 on hardware=h100x8"),
    "hardware.activation_checkpointing": Knob("bool", example="true or false"),
    "hardware.ranked": Knob("bool", example="true or false"),
    "tracking.policy_artifact_max_mb": _float(0, INF, "200 (0: never upload, tags only)"),
    "tracking.completions_per_step": _int(0, 10_000, "4 (0: none)"),
    "tracking.print_completions": _int(0, 1_000, "2 (0: none)"),
    "task.train_size": _int(1, 100_000_000, "20000"),
    "task.heldout_size": _int(1, 1_000_000, "50"),
    "task.seed": SEED,
    "task.heldout_seed": SEED,
    "task.min_number": _int(0, 1_000_000, "1"),
    "task.max_number": _int(1, 1_000_000, "99"),
    "task.min_target": _int(-1_000_000, 1_000_000, "1"),
    "task.max_target": _int(-1_000_000, 1_000_000, "99"),
}
# Lists: each element's knob and the allowed lengths.
LIST_KNOBS: dict[str, tuple[Knob, int, int, str]] = {
    "trainer.betas": (_float(0, 1, high_open=True), 2, 2, "[0.9,0.999]"),
    "evaluation.ks": (_int(1, 100_000), 1, 1_000, "[1,4,8]"),
    "task.number_counts": (_int(2, 8), 1, 10, "[3,4]"),
}
# Text knobs whose YAML default is null everywhere (their type cannot be read off a default).
NULLABLE_TEXT = ("trainer.resume_from", "tracking.run_name", "tracking.artifact_location", "hardware.autocast")


# Settings that moved to another group, with how to write them now: the replay settings of runtime=async live in
# the buffer group, as under runtime=sync (docs/async.md).
MOVED: dict[str, str] = {
    "runtime.queue": "buffer=fifo (seed 001's FIFO of rollouts) or buffer=none (its LIFO pipe)",
    "runtime.capacity": "buffer.capacity=N (rollouts)",
    "runtime.independent": "buffer.mode=with_replacement (independent draws) or buffer.mode=without_replacement",
    "runtime.positive_bias": "buffer.positive_bias=d",
    "runtime.sharded": "buffer.sharded=true (one FIFO of N/T rollouts per trainer)",
    "runtime.batch_rollouts": "buffer.batch_rollouts=B (rollouts an update draws)",
    "runtime.staleness_mode": "buffer.max_age=L for an age window (rollouts more than L updates old dropped); "
                              "runtime.staleness=eta alone is AReaL's bound, workers wait",
}

# Names other RL trainers give these knobs (TRL's GRPOConfig, verl's ppo_trainer.yaml), by their last dotted part
# (or whole, for verl's long paths): a key written as there is answered with this project's key, not a near miss.
FOREIGN_NAMES: dict[str, tuple[str, str]] = {
    "lr": ("trainer.learning_rate", "TRL's learning_rate, verl's optim.lr"),
    "num_generations": ("trainer.group_size", "TRL's completions per prompt: K here"),
    "rollout.n": ("trainer.group_size", "verl's responses per prompt: K here"),
    "max_steps": ("trainer.steps", "TRL's optimizer steps"),
    "total_training_steps": ("trainer.steps", "verl's trainer.total_training_steps"),
    "per_device_train_batch_size": ("trainer.micro_batch_size", "TRL's rows per forward/backward on a device; "
                                    "the rows of a step are trainer.groups_per_step x trainer.group_size"),
    "ppo_micro_batch_size_per_gpu": ("trainer.micro_batch_size", "verl's rows per forward/backward"),
    "train_batch_size": ("trainer.groups_per_step", "verl's prompts per step: B here"),
    "beta": ("trainer.kl_coef", "TRL's KL coefficient"),
    "kl_loss_coef": ("trainer.kl_coef", "verl's KL loss coefficient"),
    "entropy_coeff": ("trainer.entropy_coef", "verl's entropy coefficient"),
    "max_completion_length": ("policy.max_new_tokens", "TRL's response budget"),
    "max_response_length": ("policy.max_new_tokens", "verl's response budget"),
    "model_name_or_path": ("policy.name_or_path", "TRL's model"),
    "model.path": ("policy.name_or_path", "verl's model"),
    "grad_clip": ("trainer.max_grad_norm", "verl's gradient clipping"),
}


def foreign_name(key: str) -> tuple[str, str] | None:
    """(this project's key, what the other trainer calls it) for a key written as TRL or verl name it."""
    parts = key.lstrip("+~").split(".")
    for length in (2, 1):
        found = FOREIGN_NAMES.get(".".join(parts[-length:]))
        if found and len(parts) >= length and found[0] != key:
            return found
    return None


class SchemaError(ValueError):
    """Raised with the message; src.command.config turns it into its ConfigError."""


@functools.lru_cache(maxsize=8)
def yaml_defaults(root: Path = CONFIG_DIR) -> dict[str, object]:
    """Every leaf key any option of any config group under `root` sets, with one of its YAML values (non-null
    if any is)."""
    found: dict[str, object] = {}

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            if key in ("defaults", "hydra"):
                continue
            dotted = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, dotted + ".")
            elif found.get(dotted) is None:
                found[dotted] = value

    for path in sorted(Path(root).rglob("*.yaml")):
        relative = path.relative_to(root)
        if relative.parts[0] in ("sweep", "local", "hydra", "experiment"):  # sweeper grids, site and launcher
            continue  # settings: Hydra's; a paper's experiment only sets keys the groups define
        text = path.read_text()
        node = yaml.load(text, Loader=SAFE_LOADER) or {}
        is_global = "@package _global_" in text.split("\n", 1)[0] or len(relative.parts) == 1
        walk(node, "" if is_global else f"{relative.parts[0]}.")
    return found


def known_keys() -> set[str]:
    return set(yaml_defaults()) | set(KNOBS) | set(LIST_KNOBS)


def check_known(key: str, declared: frozenset[str] = frozenset()) -> None:
    """Raise SchemaError naming the close matches if no config group has the dotted key `key` and no component
    class `declared` it (a variant written outside src/ lists its new settings in its `knobs`)."""
    known = known_keys() | declared
    if key in known or any(key.startswith(list_knob + ".") for list_knob in LIST_KNOBS):
        return
    if key in MOVED:
        raise SchemaError(f"{key}: the buffer group holds this setting under runtime=async as under runtime=sync; "
                          f"write {MOVED[key]} (docs/async.md)")
    foreign = foreign_name(key)
    if foreign:
        raise SchemaError(f"{key}: unknown key; this project calls it {foreign[0]} ({key.split('.')[-1]}: "
                          f"{foreign[1]}). `python -m src.run --cfg job` lists every knob")
    close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.75)
    hint = f"did you mean {' or '.join(close)}?" if close else "no such knob exists in conf/"
    raise SchemaError(f"{key}: unknown key ({hint}); adding it with '+{key}=...' would not help, the code never "
                      "reads it. `python -m src.run --cfg job` lists every knob")


def check_override_keys(overrides: list[str], command_line: list[str] | None = None) -> None:
    """Command-line `group.key=value` overrides whose key exists nowhere, refused before Hydra composes.

    Hydra's own answer to `buffer.ratoi=2` is to suggest `+buffer.ratoi=2`, which would add a key the
    code never reads; this names the close matches instead. Group choices (`buffer=age1`), additions
    (`+sweep=...`, checked after composition) and Hydra's own keys are left to Hydra.
    """
    # A variant's YAML in a folder the command line (`command_line`, default `overrides`) puts on Hydra's search
    # path sets known keys too.
    folders = searchpath_folders(overrides if command_line is None else command_line)
    declared = frozenset(key for root in folders for key in yaml_defaults(root))
    groups = {key.split(".", 1)[0] for key in known_keys() | declared}
    for override in overrides:
        key = override.split("=", 1)[0]
        if "=" not in override or override.startswith(("+", "~", "-")) or "." not in key:
            continue
        if key.split(".", 1)[0] in groups or foreign_name(key):  # verl's long paths start outside conf/
            check_known(key, declared)


def check_values(cfg: DictConfig, describe=described) -> None:
    """Raise SchemaError for the first unknown key, or value of the wrong type (NaN and inf included) or outside
    its knob's range: each bound is declared once, on its knob, and checked here once.

    `describe` finds the class a variant group's node names; where it answers None (`src.command.cli` before torch
    loads: `src.variant.described_without_heavy_modules`) that group's settings are left to a later check."""
    classes = {group: describe(cfg.get(group)) for group in VARIANT_GROUPS}
    later = {group for group, found in classes.items() if found is None}
    values = {key: value for key, value in _task_leaves(cfg).items() if key.split(".", 1)[0] not in later}
    task_knobs = _task_knobs(cfg, values, describe)
    if task_knobs is None:  # the task's class needs torch or the like: its own settings are checked later
        values, task_knobs = {key: value for key, value in values.items() if not key.startswith("task.")}, {}
    defaults = yaml_defaults()
    found = {**KNOBS, **_component_knobs(classes), **task_knobs}
    for key in values:
        check_known(key, frozenset(found))
    for key, value in values.items():
        if key in LIST_KNOBS:
            _check_list(key, value)
        else:
            _check_value(key, value, found[key] if key in found else _knob_from_default(key, defaults.get(key)))
    problem = out_problem(str(values["out"])) if "out" in values else None  # a folder, not a typed value
    if problem:
        raise SchemaError(problem)


def _task_knobs(cfg: DictConfig, values: dict, describe) -> dict[str, Knob] | None:
    """The knobs the task's class declares (`Task.knobs`), read only when the config sets a task key that no YAML
    of conf/ has (the task classes' imports take a second); None when its class is not importable yet."""
    known = known_keys()
    own = [key for key in values if key.startswith("task.") and key not in known]
    if not own or "_target_" not in (cfg.get("task") or {}):
        return {}
    found = describe(cfg.task)
    return None if found is None else {f"task.{name}": knob for name, knob in found.knobs.items()}


def knobs_for(cfg: DictConfig) -> dict[str, Knob]:
    """Every declared knob of this config: `KNOBS` and those of the classes its variant groups name."""
    return {**KNOBS, **_component_knobs({group: described(cfg.get(group)) for group in VARIANT_GROUPS})}


def _component_knobs(classes: dict[str, type | None]) -> dict[str, Knob]:
    return {f"{group}.{name}": knob for group, found in classes.items() if found is not None
            for name, knob in found.knobs.items()}


def check_unused_settings(cfg: DictConfig, overrides: list[str], choices, describe=described,
                          roots: tuple[Path, ...] = ()) -> None:
    """Raise SchemaError for a command-line `group.key=value` that the group's chosen class does not declare
    among its knobs while another option's class of the group does (`buffer=none buffer.max_age=2`): the
    setting would change nothing. Keys no class declares (a label, a switch) are left alone; so is a group
    whose class `describe` cannot give yet (None). `choices`: each group's option (Hydra's runtime.choices)."""
    for word in overrides:
        key = word.split("=", 1)[0]
        if "=" not in word or word.startswith(("+", "~", "-")) or key.count(".") != 1:
            continue
        group, name = key.split(".")
        chosen = describe(cfg.get(group)) if group in VARIANT_GROUPS else None
        if chosen is not None and name in chosen.knobs:
            _check_queue_only(word, group, name, chosen.knobs[name], cfg, choices, describe, roots)
        if chosen is None or name in chosen.knobs:
            continue
        users = _options_where(group, lambda option: name in option.knobs, describe, (CONFIG_DIR, *roots))
        if users:
            raise SchemaError(f"{word}: {group}={choices.get(group, '?')} has no knob {name} (its knobs: "
                              f"{', '.join(sorted(chosen.knobs)) or 'none'}), so the setting would change nothing; "
                              f"pick a {group} that uses it, e.g. {group}={users[0]}, or drop {key}")


def _keeps_its_queue(runtime) -> bool:
    """Whether a runtime class keeps the replay itself, in the option's rollout queue (`Runtime.step_replays`)."""
    return getattr(runtime, "step_replays", True) is False


def _check_queue_only(word: str, group: str, name: str, knob, cfg, choices, describe, roots) -> None:
    """A knob that sizes a runtime's own rollout queue (`Knob.queue_only`), set under a runtime whose step replays
    from the store instead: it would change nothing."""
    runtime = describe(cfg.get("runtime")) if knob.queue_only else None
    if runtime is None or _keeps_its_queue(runtime):
        return
    acting = " or ".join(f"runtime={option}" for option in
                         _options_where("runtime", _keeps_its_queue, describe, (CONFIG_DIR, *roots)))
    raise SchemaError(f"{word}: {group}={choices.get(group, '?')} reads {name} under {acting} only, so under "
                      f"runtime={choices.get('runtime', '?')} the setting would change nothing; add {acting}, or "
                      f"drop {group}.{name}")


def _options_where(group: str, test, describe, roots) -> list[str]:
    """The options of `group` (under each config root) whose class passes `test`."""
    found = []
    for root in roots:
        for path in sorted((Path(root) / group).glob("*.yaml")):
            target = (yaml.safe_load(path.read_text()) or {}).get("_target_")
            try:
                described_class = describe({"_target_": target}) if target else None
            except (ImportError, AttributeError):  # an option that cannot be picked: its own check names it
                continue
            if described_class is not None and test(described_class):
                found.append(path.stem)
    return found


def _task_leaves(cfg: DictConfig) -> dict[str, object]:
    return _leaves({key: OmegaConf.to_container(cfg[key], resolve=True) if OmegaConf.is_config(cfg[key])
                    else cfg[key] for key in cfg if key != "hydra"})


def _leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    """Dotted leaf keys of a plain tree; lists stay whole (they are one knob)."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and f"{prefix}{key}" not in LIST_KNOBS:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _knob_from_default(key: str, default) -> Knob:
    if key in NULLABLE_TEXT:
        return Knob("text", nullable=True)
    if isinstance(default, bool):
        return Knob("bool", example="true or false")
    if isinstance(default, int):
        return Knob("int", example=str(default))
    if isinstance(default, float):
        return Knob("float", example=str(default))
    if isinstance(default, str):
        return Knob("text", example=default)
    if isinstance(default, list):
        return Knob("list", example=str(default).replace(" ", ""))
    return Knob("any", nullable=True)


def _check_value(key: str, value, knob: Knob) -> None:
    shown = f"{key}={_show(value)}"
    fix = f" (e.g. {key}={knob.example})" if knob.example else ""
    if value is None:
        if not knob.nullable and knob.kind != "any":
            raise SchemaError(f"{shown}: a value is required here{fix}")
        return
    if knob.kind == "bool":
        if not isinstance(value, bool):
            raise SchemaError(f"{shown}: must be true or false")
        return
    if knob.kind == "text":
        if isinstance(value, (bool, list, dict)):
            raise SchemaError(f"{shown}: must be text{fix}")
        return
    if knob.kind == "list":
        if not isinstance(value, list):
            raise SchemaError(f"{shown}: must be a list{fix}")
        return
    if knob.kind == "any":
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise SchemaError(f"{shown}: must be {'an integer' if knob.kind == 'int' else 'a number'}{fix}")
    if not math.isfinite(value):
        raise SchemaError(f"{shown}: must be a finite number{fix}")
    if knob.kind == "int" and not isinstance(value, int):
        raise SchemaError(f"{shown}: must be an integer, written without a decimal point{fix}")
    too_low = value < knob.low or (knob.low_open and value == knob.low)
    too_high = value > knob.high or (knob.high_open and value == knob.high)
    if too_low or too_high:
        why = f": {knob.why}" if knob.why else ""
        raise SchemaError(f"{shown}: out of range, must be {_range(knob)}{why}{fix}")


def _check_list(key: str, value) -> None:
    element, shortest, longest, example = LIST_KNOBS[key]
    if not isinstance(value, list):
        raise SchemaError(f"{key}={_show(value)}: must be a list (e.g. {key}={example})")
    if not shortest <= len(value) <= longest:
        size = f"exactly {shortest}" if shortest == longest else f"{shortest} to {longest}"
        raise SchemaError(f"{key}={_show(value)}: must hold {size} values (e.g. {key}={example})")
    for item in value:
        try:
            _check_value(key, item, element)
        except SchemaError as error:
            raise SchemaError(f"{key}={_show(value)}: each value {str(error).split(': ', 1)[1]} "
                              f"(e.g. {key}={example})") from None


def _range(knob: Knob) -> str:
    low = "" if knob.low == -INF else f"{_number(knob.low)} {'<' if knob.low_open else '<='} "
    high = "" if knob.high == INF else f" {'<' if knob.high_open else '<='} {_number(knob.high)}"
    return f"{low}value{high}" + (" (or null)" if knob.nullable else "")


def _number(value: float) -> str:
    return f"{int(value):,}".replace(",", "_") if float(value).is_integer() and abs(value) >= 10_000 else f"{value:g}"


def _show(value) -> str:
    return repr(value) if isinstance(value, str) else str(value).replace(" ", "")
