"""How a variant component describes itself, so the runner, planner, sweep naming and validation never ask its name.

Every class a variant group's `_target_` names (buffer, loss, behaviour, sampling, curriculum,
runtime) answers these from its group's config node, as class methods, so nothing heavy is built to
ask them:

* `cell_label(node, cfg)`: its part of the cell name (`src.study.sweep.cell_name`), e.g. '-stale4';
  `reader_label(node, cfg)`: its part of the reader's name (`src.study.sweep.variant_label`).
* `plain(node)`: whether these settings compute plain Replay-RLOO, so the cell identity leaves the
  group out (`src.study.sweep.cell_identity`, rule 3).
* `check(node, run)`: feasibility across groups (e.g. a FIFO's capacity against B_replay), raising
  ValueError with one line naming the key, the value and the fix (`src.command.config.validate`).
* `knobs`: its settings' types and ranges, keyed by the setting's name in the group (`src.validate.schema`).
* `budget_plan(node, run)` / `budget_is_floor(node)`: a plan of its own (a runtime with its own schedule),
  and whether a step may generate more fresh groups than the plan counts.

A replay store also says what the budget planner simulates (`src.buffer.store.ReplayStore`). A label
gets the whole config `cfg` where it needs another group (e.g. clip.ceiling); a check and a plan get
the run's typed settings `run` (`src.settings.RunSettings`: its trainer, hardware and component nodes).
A new variant is then one class and one YAML: nothing else in `src/` lists it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import inspect
import math
import sys
from dataclasses import dataclass
from typing import ClassVar

INF = math.inf

# The config groups whose component describes itself, in the order a cell's name lists them.
VARIANT_GROUPS = ("buffer", "loss", "sampling", "behaviour", "curriculum", "runtime")


@dataclass(frozen=True)
class Knob:
    """A setting's type and range, for `src.validate.schema`'s one-line messages."""

    kind: str  # "int" | "float" | "bool" | "text" | "list" | "any"
    low: float = -INF
    high: float = INF
    low_open: bool = False  # the bound itself is refused (e.g. a learning rate of 0)
    high_open: bool = False
    nullable: bool = False
    example: str = ""  # a value that works, for the message
    why: str = ""      # what the bound protects, for the message (e.g. "leave-one-out needs K >= 2")
    # A knob added after cell ids were fixed names the value every earlier cell computed: at it, the knob
    # stays out of the cell id (`src.study.sweep.cell_identity`), so adding a knob keeps every existing id.
    id_omitted_at: tuple = ()
    # The knob sizes the rollout queue a runtime keeps for itself (`Runtime.step_replays` false): under a runtime
    # whose step replays from the store, setting it is refused.
    queue_only: bool = False


def int_knob(low=-INF, high=INF, example="", **kw) -> Knob:
    return Knob("int", low, high, example=example, **kw)


def float_knob(low=-INF, high=INF, example="", **kw) -> Knob:
    return Knob("float", low, high, example=example, **kw)


class Variant:
    """The self-description every variant component class inherits: no label, no check, not plain."""

    knobs: ClassVar[dict[str, Knob]] = {}

    # A variant whose settings never change its label names it here; one whose settings do overrides the methods.
    cell_tag: ClassVar[str] = ""
    reader_tag: ClassVar[str] = ""

    @classmethod
    def cell_label(cls, node, cfg) -> str:
        return cls.cell_tag

    @classmethod
    def reader_label(cls, node, cfg) -> str:
        return cls.reader_tag

    @classmethod
    def plain(cls, node) -> bool:
        """False unless overridden: a component that is not known to be plain keeps its settings in the cell."""
        return False

    @classmethod
    def check(cls, node, run) -> None:
        """Raise ValueError, in the class's words, when its settings `node` cannot run with the rest of the run
        (`run`: the run's typed settings, `src.settings.RunSettings`)."""
        return None

    @classmethod
    def budget_plan(cls, node, run):
        """The run's (`src.settings.RunSettings`) `src.study.budget.BudgetPlan` when this component replaces SPEC 3's schedule (the asynchronous
        runtime's lockstep clock); None: the replay store's simulation decides."""
        return None

    @classmethod
    def budget_is_floor(cls, node) -> bool:
        """True when a step may generate more than the plan counts (DAPO's rounds): the plan is then a minimum."""
        return False


def described(node, interface: type | None = None) -> type:
    """The class that describes a group's settings: the one its `_target_` names (a class, or a classmethod
    that builds one); the group's `interface` itself (default `Variant`) for a target that is not one of its
    classes (e.g. a plain function), whose defaults then answer."""
    return _describing(load_target(str(node["_target_"])), interface)


def _describing(found, interface: type | None = None) -> type:
    interface = interface or Variant
    if inspect.ismethod(found) and isinstance(found.__self__, type):
        found = found.__self__  # `Class.from_config`: the class describes itself
    return found if isinstance(found, type) and issubclass(found, interface) else interface


# The libraries a command-line check waits for no longer than it must (`src.command.cli`): seconds to import each.
HEAVY_MODULES = ("torch", "transformers", "mlflow", "vllm", "ray")


class NeedsHeavyModule(Exception):
    """Not an ImportError: a module that falls back when an optional import fails must not catch it."""


class _RefuseHeavyModules(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HEAVY_MODULES:
            raise NeedsHeavyModule(name)
        return None  # the other finders find it


def described_without_heavy_modules(node) -> type | None:
    """`described(node)` when its class's module imports without the HEAVY_MODULES (or they are loaded already),
    else None: `src.command.cli` checks a command line with the classes that describe themselves within a second (the
    replay stores), and `src.command.config.validate` checks the rest once the run has imported them. A module whose
    import is cut short is dropped from sys.modules by the import system, so the run imports it afresh."""
    found = _load_without_heavy_modules(str(node["_target_"]))
    return None if found is _NEEDS_HEAVY else _describing(found)


def load_target_without_heavy_modules(target: str) -> None:
    """`load_target(target)`, raising its own error for a target that names nothing; NeedsHeavyModule where only
    importing a HEAVY_MODULE would tell (`src.command.cli`'s check leaves those to `validate`)."""
    if _load_without_heavy_modules(target) is _NEEDS_HEAVY:
        raise NeedsHeavyModule(target)


_NEEDS_HEAVY = object()  # what `_load_without_heavy_modules` gives for a target only a HEAVY_MODULE would load


def _load_without_heavy_modules(target: str):
    """`load_target(target)`, or _NEEDS_HEAVY where its module imports a HEAVY_MODULE not loaded yet."""
    refuse = _RefuseHeavyModules()
    sys.meta_path.insert(0, refuse)
    try:
        return load_target(target)
    except NeedsHeavyModule:
        return _NEEDS_HEAVY
    finally:
        sys.meta_path.remove(refuse)


def load_target(target: str):
    """What a `_target_` names: `module.Name`, or `module.Class.method`. Raises the import's own error (one line,
    e.g. "No module named 'no'"), which `src.command.config` shows with the key."""
    module, _, name = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as missing:
        outer, _, owner = module.rpartition(".")
        try:  # `module.Class.method`: the class's module imports, the class holds the method
            holder = getattr(importlib.import_module(outer), owner) if outer else None
        except (ImportError, AttributeError):
            holder = None
        if holder is None or isinstance(holder, type(importlib)):
            raise missing from None
        return getattr(holder, name)


def check_recipe(group: str, method: str, mechanism: str, node, run, loss_label: str = "-grpo") -> None:
    """An option that is one paper's whole recipe (seed 003 appendix D.2: POPO, DAPO) selects its loss (the one
    labelled `loss_label`) and trainer.kl_coef=0 itself, so a loss or KL term on top of it is a mistake unless
    `mechanism_only` asks for the mechanism alone (conf/sweep/variants.yaml's POPO-on-RLOO cell does)."""
    if node.get("mechanism_only", False):
        return
    loss_node = run.groups.loss
    option, loss = node.get("name", group), loss_node.get("name", "?")  # the YAML names, for the message only
    opt_out = f"or add {group}.mechanism_only=true to run the {mechanism} alone on the loss and KL you choose"
    if described(loss_node).cell_label(loss_node, run.groups) != loss_label:
        raise ValueError(f"{group}={option} with loss={loss}: {method} optimises the GRPO clipped surrogate (seed 003 "
                         f"D.2), which {group}={option} selects by itself; drop loss={loss}, {opt_out}")
    if run.trainer.kl_coef != 0:
        raise ValueError(f"{group}={option} with trainer.kl_coef={run.trainer.kl_coef}: {method} trains without a KL "
                         f"penalty (seed 003 D.2), and {group}={option} sets 0 by itself; drop the override, {opt_out}")
