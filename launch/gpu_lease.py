"""A GPU lease's preflight (`make gpu-lease OUT=DIR [PART=1|2] [DEVICE=cuda|cpu]`; docs/benchmarks.md, "A GPU lease").

On the lent node, in one device call per part, each part under 8 minutes (PART_SECONDS bounds it):

  part 1: install the bundle, check the imports, `benchmarks.vllm_probe` (vLLM's host overhead, at most 270 s),
          `benchmarks.gpu_step --compile` at 256 and 1024 tokens (vLLM colocated, 1024 sequences a wave),
          shared/bench's update_reference.py beside it (read back when part 1 ran before on the same warm
          machine), `pytest -m gpu`                                                          (estimate 8 min)
  part 2: install, imports, a whole `src.run` cell of the 0.5B shape (3 steps, smoke evaluation, final
          checkpoint, per-phase times, peak), one step of the 1.5B preset with its peak beside the memory plan,
          3 steps under torchrun on the ranked path in a group of one (hardware.ranked: FSDP2, vLLM asleep
          while training) read back from MLflow, `benchmarks.update_ops`                     (estimate 9 min)

Every stage runs in its own process group under a time limit (the smaller of its own and what the part has
left), so a hang costs that stage alone; a failed stage is recorded and the next one runs. Everything lands in
OUT as two files a part (the device returns at most 8): `partN.json`, every figure of every stage, and
`partN.log`, every stage's output. DEVICE=cpu rehearses the same stages at tiny shapes with this Python's
packages (the HF engine, a tiny random 1.5B-shaped policy), so a typo cannot waste a GPU window.

The bundle (`make gpu-bundle`) comes in carry folders, one a device call: each call stashes the pieces it
brings in the work folder (/tmp/rr-lease, kept while the machine stays warm) and the bundle is unpacked there
once all pieces are in. A part that finds pieces missing says which carry folder to bring and stops.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launch import bundle  # noqa: E402

PART_SECONDS = {"cuda": 470, "cpu": 1200}  # the whole part, install included: under 8 minutes on the GPU
SLACK = {"cuda": 1, "cpu": 4}  # the rehearsal checks the wiring, not the time: a busy CPU may take 4 times longer
# Sized by what an H200 takes (benchmarks/results/README.md): a fresh process with vLLM needs about 130 s to its
# first step (imports, vLLM's first look at an architecture, the engine's 43-64 s), the 0.5B cell's three steps
# 82 s more, then its evaluation and checkpoint; the probe's engine is ready after about 120 s.
LIMITS = {"install": 120, "imports": 90, "pytest": 200, "gpu_step": 300, "update_reference": 150,
          "update_ops": 120, "torchrun": 200, "cell_0.5b": 330, "preset_1.5b": 260, "vllm_probe": 270}
PRESET = "Qwen/Qwen2.5-1.5B"   # conf/policy/qwen2.5-1.5b.yaml's policy
CELL = "Qwen/Qwen2.5-0.5B"     # conf/policy/qwen2.5-0.5b.yaml's: the papers' shape, a whole cell of it
TINY_RUN = ["trainer.groups_per_step=4", "trainer.group_size=2", "policy.max_new_tokens=6", "hardware.threads=1"]


class Lease:
    """One part's stages, their figures and log."""

    def __init__(self, args) -> None:
        self.args, self.cuda = args, args.device == "cuda"
        self.work = args.work or (Path("/tmp/rr-lease") if self.cuda else args.out / "work")
        self.site = self.work / "site"
        self.deadline = time.monotonic() + (args.seconds or PART_SECONDS[args.device])
        args.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.log_path = args.out / f"part{args.part}.log"
        self.log = self.log_path.open("a")
        self.summary = {"part": args.part, "device": args.device, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                        time.gmtime()), "python": sys.executable, "stages": {}}

    def env(self) -> dict:
        # The bundle is built for the node's Python (3.12, launch/bundle.py): the CPU rehearsal unpacks it to rehearse
        # the install, and runs its stages on this Python's own packages.
        paths = [str(self.site)] if self.cuda and (self.site / bundle.MANIFEST).is_file() else []
        return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [str(ROOT)]), "PYTHONUNBUFFERED": "1",
                "VLLM_USE_FLASHINFER_SAMPLER": "0", "TOKENIZERS_PARALLELISM": "false", "HYDRA_FULL_ERROR": "1"}

    def note(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def run(self, name: str, command: list[str], figures=None) -> dict:
        """`command` under the stage's limit in its own process group; `figures()` read after it, if it ran."""
        left = self.deadline - time.monotonic() - 5  # seconds kept to write the figures
        limit = min(LIMITS.get(name.split(":")[0], 120) * SLACK[self.args.device], left)
        if left < 5:
            return self.record(name, {"status": "skipped", "reason": "the part's time was spent"})
        self.note(f"=== {name} (limit {limit:.0f} s): {' '.join(command)}")
        start = time.monotonic()
        process = subprocess.Popen(command, cwd=ROOT, env=self.env(), stdout=self.log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            stop_group(process)
            code = None
        result = {"status": "ok" if code == 0 else "timed out" if code is None else "failed", "returncode": code,
                  "seconds": round(time.monotonic() - start, 2)}
        if figures is not None:
            try:
                result.update(figures())
            except Exception as error:  # noqa: BLE001  (a stage's missing output is recorded, not raised)
                result["figures_error"] = f"{type(error).__name__}: {error}"
        return self.record(name, result)

    def record(self, name: str, result: dict) -> dict:
        self.summary["stages"][name] = result
        self.note(f"--- {name}: {result['status']}" + (f" in {result['seconds']} s" if "seconds" in result else ""))
        self.write()
        return result

    def write(self) -> None:
        self.summary["seconds_left"] = round(self.deadline - time.monotonic(), 1)
        (self.args.out / f"part{self.args.part}.json").write_text(json.dumps(self.summary, indent=1, default=str))


def stop_group(process: subprocess.Popen) -> None:
    """The stage and everything it started (vLLM's engine, torchrun's ranks): SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def install(lease: Lease) -> bool:
    """Stash the pieces this call carried, then unpack the bundle once they are all in; False: cannot go on."""
    start, stash = time.monotonic(), lease.work / "pieces"
    stash.mkdir(parents=True, exist_ok=True)
    carried = sorted(lease.args.bundle.glob("carry*")) if lease.args.bundle.is_dir() else []
    for folder in carried:
        for path in folder.iterdir():
            kept = stash / path.name  # what this call carried wins over what an earlier call left
            if path.is_file() and (not kept.is_file() or kept.read_bytes() != path.read_bytes()):
                shutil.copyfile(path, kept)
    if not (stash / bundle.MANIFEST).is_file():
        status = "no bundle" if not lease.cuda else "failed"
        lease.record("install", {"status": status, "reason": f"no bundle in {lease.args.bundle} or {stash}: "
                                 "make gpu-bundle, then carry gpu-bundle/carry1", "seconds": 0})
        return not lease.cuda
    manifest = json.loads((stash / bundle.MANIFEST).read_text())
    marker = lease.site / bundle.MANIFEST
    if marker.is_file() and json.loads(marker.read_text())["sha256"] == manifest["sha256"]:
        return lease.record("install", {"status": "ok", "reused": str(lease.site), "seconds": 0}) is not None
    try:
        data, missing, manifest = bundle.gather([stash])
    except bundle.BundleError as error:
        lease.record("install", {"status": "failed", "reason": str(error)})
        return False
    if missing:
        needed = sorted({f"gpu-bundle/carry{n}" for n, group in enumerate(manifest["carries"], 1)
                         for name in group if name in missing})
        lease.record("install", {"status": "incomplete", "missing": missing, "carry next": needed,
                                 "reason": f"pieces stashed in {stash}; call again carrying {', '.join(needed)} "
                                           "while this machine is warm"})
        return False
    if lease.site.exists():
        shutil.rmtree(lease.site)
    (lease.work / "imports.json").unlink(missing_ok=True)  # a new bundle: its imports are checked afresh
    bundle.extract(data, lease.site)
    shutil.copyfile(stash / bundle.MANIFEST, marker)
    lease.record("install", {"status": "ok", "seconds": round(time.monotonic() - start, 2), "bytes": len(data),
                             "site": str(lease.site)})
    return True


def reference_script(lease: Lease) -> Path | None:
    """update_reference.py: the copy the bundle carries, else shared/bench beside the repo."""
    for path in (lease.work / "pieces" / "update_reference.py", bundle.REFERENCE):
        if path.is_file():
            return path
    return None


def read_json(path: Path) -> dict:
    return {"figures": json.loads(path.read_text())}


def probe_stage(lease: Lease, python: str) -> None:
    """vLLM's host overhead (benchmarks/vllm_probe.py): one engine start, each variant's call at 512 and 1024
    sequences, a profile; at tiny shapes where the rehearsal's Python has the CPU vLLM."""
    if not lease.cuda and importlib.util.find_spec("vllm") is None:
        lease.record("vllm_probe", {"status": "missing", "reason": "no vLLM in this Python (LEASE_PY="
                                    ".venv-vllm/bin/python rehearses it with the CPU build)"})
        return
    target = lease.work / "vllm_probe.json"
    target.unlink(missing_ok=True)
    sizes = [] if lease.cuda else ["--tiny", "--device", "cpu", "--waves", "8,16", "--response-tokens", "8",
                                   "--prompt-tokens", "16"]
    lease.run("vllm_probe", [python, "-m", "benchmarks.vllm_probe", "--folder", str(lease.work / "probe-policy"),
                             "--json", str(target), *sizes], lambda: read_json(target))


def part_one(lease: Lease, python: str) -> None:
    probe_stage(lease, python)  # what part 2 leaves of the window goes first to vLLM's host overhead
    work, cuda = lease.work, lease.cuda
    results = work / "gpu_step"
    shutil.rmtree(results, ignore_errors=True)
    # The compiled update, vLLM colocated, beside the plain loop's bf16 + compile (47.4 % MFU against 41.9 % on the
    # H200, 2026-11-30; benchmarks/results/README.md), and vLLM's next lever: the 1024 rows in one wave of 1024
    # sequences, CUDA graphs captured up to 1024 (37.7k tokens/s in two waves of 512 that day).
    step = (["--engine", "vllm", "--response-tokens", "256,1024", "--vllm-max-num-seqs", "1024"] if cuda else
            ["--tiny", "--device", "cpu", "--response-tokens", "8,16"])
    lease.run("gpu_step", [python, "-m", "benchmarks.gpu_step", *step, "--ratios", "0", "--compile", "--label",
                           "compile-seqs1024" if cuda else "compile", "--save", "--results", str(results)],
              lambda: saved_figures(results))
    reference_stage(lease, python)
    pytest_xml = work / "pytest.xml"
    pytest_xml.unlink(missing_ok=True)  # a run stopped at its limit must not be read as an earlier call's outcome
    lease.run("pytest", [python, "-m", "pytest", "-q", "-m", "gpu", "tests/e2e/test_gpu.py", "-p", "no:cacheprovider",
                         f"--junitxml={pytest_xml}"], lambda: junit_figures(pytest_xml))


def saved_figures(folder: Path) -> dict:
    return {"figures": {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}}


def reference_stage(lease: Lease, python: str) -> None:
    """The plain loop update_reference.py beside the trainer, in part 1 (speed claims are ratios on one card in
    one lease); a part 1 run again on the same warm machine reads its figures back."""
    script, target = reference_script(lease), lease.work / "update_reference.json"
    if script is None:
        lease.record("update_reference", {"status": "missing", "reason": f"no {bundle.REFERENCE}"})
        return
    if lease.cuda and target.is_file():
        lease.record("update_reference", {"status": "ok", "reused": str(target), **read_json(target)})
        return
    target.unlink(missing_ok=True)
    shapes = [] if lease.cuda else ["--tiny", "--variants", "fp32+autocast"]  # CPU: compiling would take minutes
    lease.run("update_reference", [python, str(script), "--out", str(target), *shapes], lambda: read_json(target))


def junit_figures(path: Path) -> dict:
    import xml.etree.ElementTree as ElementTree

    cases = {}
    for case in ElementTree.parse(path).iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        cases[case.get("name")] = {"outcome": outcome, "seconds": float(case.get("time", 0))}
    counts = {outcome: sum(c["outcome"] == outcome for c in cases.values())
              for outcome in ("passed", "failure", "error", "skipped")}
    return {"figures": {"counts": counts, "tests": cases}}


def run_overrides(lease: Lease, folder: Path) -> list[str]:
    """Where a lease run writes (its own store, so its metrics are read back alone), on which hardware."""
    store = [f"out={folder}", f"tracking.uri=sqlite:///{folder}/mlruns.db",
             f"tracking.artifact_location={folder}/mlartifacts", "tracking.sweep=lease", "evaluation=smoke",
             "evaluation.at_start=false"]
    if lease.cuda:
        return store + ["hardware=h100", "hydra/launcher=basic", "policy.engine=vllm", "policy.vllm.sleep=true"]
    if importlib.util.find_spec("vllm") is not None:  # under .venv-vllm: the CPU build (no sleep mode there)
        return store + ["hardware=cpu", "policy.engine=vllm", "policy.vllm.dtype=float32",
                        "policy.vllm.enforce_eager=true", "policy.vllm.kv_cache_gib=0.1"]
    return store + ["hardware=cpu", "policy.engine=hf"]


def part_two(lease: Lease, python: str) -> None:
    """What no lease has finished first (the whole 0.5B cell, the 1.5B preset), then the ranked path in a group of
    one (on record: benchmarks/results/README.md), the operator counts last."""
    whole_cell(lease, python)
    one_point_five(lease, python)
    ranked_path(lease, python)
    target = lease.work / "update_ops.json"
    target.unlink(missing_ok=True)
    dtype = "bfloat16" if lease.cuda else "float32"  # the card's update runs bf16 compute weights under autocast
    script = reference_script(lease)  # the bundle's copy: shared/bench does not travel to the node
    lease.run("update_ops", [python, "-m", "benchmarks.update_ops", "--device", lease.args.device, "--dtype", dtype,
                             "--json", str(target), *(["--reference", str(script)] if script else [])],
              lambda: read_json(target))


def ranked_path(lease: Lease, python: str) -> None:
    """3 steps under torchrun in a group of one. One GPU holds one NCCL rank: hardware.ranked puts the one process
    on the ranked path (FSDP2 over a mesh of one, vLLM's external_launcher, asleep while training)."""
    folder = lease.work / f"torchrun-{time.strftime('%H%M%S')}"
    ranks = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "src.run",
             "hardware.ranks=1", "hardware.ranked=true", "trainer.steps=3", *run_overrides(lease, folder),
             *([] if lease.cuda else TINY_RUN)]
    lease.run("torchrun", ranks, lambda: metric_figures(python, folder, lease))


def random_policy(lease: Lease, python: str, preset: str, name: str) -> Path | None:
    """The preset's architecture on random weights in the work folder (tiny on the CPU); None if that failed."""
    policy = lease.work / (f"policy-{name}" if lease.cuda else f"policy-{name}-tiny")
    made = lease.run(f"{'cell_' if preset == CELL else 'preset_'}{name}:weights",
                     [python, str(Path(__file__)), "random-policy", "--preset", preset, "--folder", str(policy),
                      "--device", lease.args.device, *([] if lease.cuda else ["--tiny"])])
    return policy if made["status"] == "ok" else None


def whole_cell(lease: Lease, python: str) -> None:
    """`python -m src.run` as a study's job runs it, on the 0.5B shape (random weights) with vLLM colocated and
    asleep while training: 3 steps, the smoke evaluation, the final checkpoint; its status, every phase's time
    per step from its MLflow store, and its peak."""
    policy = random_policy(lease, python, CELL, "0.5b")
    if policy is None:
        return
    folder, peak = lease.work / f"cell-{time.strftime('%H%M%S')}", lease.work / "peak_0.5b.json"
    peak.unlink(missing_ok=True)
    shapes = (["policy.max_new_tokens=256"] if lease.cuda else
              ["trainer.groups_per_step=2", "trainer.group_size=2", "policy.max_new_tokens=4", "hardware.threads=1"])
    command = [python, str(Path(__file__)), "peak", "--json", str(peak), "--", "src.run", "policy=qwen2.5-0.5b",
               f"policy.name_or_path={policy}", "trainer.steps=3", *run_overrides(lease, folder), *shapes]
    lease.run("cell_0.5b", command, lambda: {**read_json(peak), **metric_figures(python, folder, lease),
                                             "checkpoints": [str(path) for path in folder.rglob("checkpoint.pt")]})


def one_point_five(lease: Lease, python: str) -> None:
    """One step of the 1.5B preset on random weights (the node has no hub), its peak beside the memory plan."""
    work, cuda = lease.work, lease.cuda
    policy = random_policy(lease, python, PRESET, "1.5b")
    if policy is None:
        return
    folder, peak = work / f"preset-{time.strftime('%H%M%S')}", work / "peak_1.5b.json"
    peak.unlink(missing_ok=True)
    shapes = (["policy.max_new_tokens=256"] if cuda else
              ["trainer.groups_per_step=2", "trainer.group_size=2", "policy.max_new_tokens=4", "hardware.threads=1"])
    command = [python, str(Path(__file__)), "peak", "--json", str(peak), "--", "src.run", "policy=qwen2.5-1.5b",
               f"policy.name_or_path={policy}", "trainer.steps=1", *run_overrides(lease, folder), *shapes]
    lease.run("preset_1.5b", command, lambda: {**read_json(peak), "plan": plan_figures(python, lease),
                                               **metric_figures(python, folder, lease)})


def metric_figures(python: str, folder: Path, lease: Lease) -> dict:
    """The run's time/* metrics by step, read from its MLflow store (in a child: mlflow is the bundle's)."""
    target = folder / "metrics.json"
    subprocess.run([python, str(Path(__file__)), "metrics", "--store", f"sqlite:///{folder}/mlruns.db", "--json",
                    str(target)], cwd=ROOT, env=lease.env(), stdout=lease.log, stderr=subprocess.STDOUT, timeout=120)
    return {"metrics": json.loads(target.read_text())}


def plan_figures(python: str, lease: Lease) -> dict:
    """The preset's memory plan (`memory_plan`), worked out in a child: it reads the config with omegaconf, which
    the node's image lacks and only the bundle's path gives."""
    target = lease.work / "plan_1.5b.json"
    target.unlink(missing_ok=True)
    subprocess.run([python, str(Path(__file__)), "plan", "--json", str(target)], cwd=ROOT, env=lease.env(),
                   stdout=lease.log, stderr=subprocess.STDOUT, timeout=120)
    return json.loads(target.read_text())


def plan_main(args) -> int:
    Path(args.json).write_text(json.dumps(memory_plan(), indent=1))
    return 0


def memory_plan() -> dict:
    """The plan `src.distributed.memory` prints for the preset on one GPU with its vLLM engine asleep (as the
    SLURM dry run of policy=qwen2.5-1.5b hardware=h100 policy.vllm.sleep=true plans it), in GiB, and the
    training peak it counts at the preset's own micro-batch (trainer=paper), with and without checkpointing."""
    from omegaconf import OmegaConf

    from src.distributed import memory

    shape, engine = memory.policy_shape(PRESET), memory.EngineShare(0.3, True)
    tokens = OmegaConf.load(ROOT / "conf" / "trainer" / "paper.yaml").micro_batch_tokens  # the preset's trainer
    cell = memory.Cell(micro_batch_tokens=tokens)
    fit = memory.best_fit(shape, 1, engine.training_gib(memory.H100_GIB), cell)
    generation = memory.generation_plan(shape, 1, engine, cell)
    at_run = {f"training_gib_at_{tokens}_tokens" + ("_checkpointed" if checkpointed else ""):
              round(memory.peak_gib(shape, 1, replace(cell, activation_checkpointing=checkpointed)), 2)
              for checkpointed in (False, True)}
    return {"policy": PRESET, **at_run, "training_gib": round(fit.peak_gib, 2),
            "micro_batch_tokens": fit.micro_batch_tokens,
            "activation_checkpointing": fit.activation_checkpointing, "engine_share_gib": round(generation.share, 2),
            "resident_while_generating_gib": round(generation.resident, 2),
            "lines": memory.job_plan_lines([PRESET], 1, engine, cell)}


def lease_main(args) -> int:
    lease = Lease(args)
    python = sys.executable
    lease.note(f"part {args.part} on {args.device}, work folder {lease.work}, "
               f"{args.seconds or PART_SECONDS[args.device]:.0f} s at most")
    if not install(lease):  # the call that carries the first pieces only stashes them: seconds, not minutes
        lease.write()
        return 3
    warming = warm_registry(lease, python)
    imports_stage(lease, python)
    (part_one if args.part == 1 else part_two)(lease, python)
    record_warm(lease, warming)
    lease.summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    lease.write()
    failed = [name for name, stage in lease.summary["stages"].items() if stage["status"] in ("failed", "timed out")]
    lease.note(f"part {args.part} done: {len(lease.summary['stages'])} stages, "
               + (f"failed: {', '.join(failed)}" if failed else "none failed") + f"; figures in {args.out}")
    return 1 if failed else 0


# vLLM inspects a model class in a child process the first time it meets its architecture on a machine, and keeps
# the answer under VLLM_CACHE_ROOT/modelinfos (vllm/model_executor/models/registry.py, `inspect_model_cls` and
# `_run_in_subprocess`): about 30 s for each engine's first architecture on the H200 (benchmarks/results/README.md).
# Inspected in the background beside the import check, one process an architecture, the stages' engines find it.
WARM_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")  # the Qwen cells' and the tiny policy's
WARM_CODE = ("import sys, time; from vllm.model_executor.models.registry import ModelRegistry; start = time.time(); "
             "ModelRegistry.models[sys.argv[1]].inspect_model_cls(); "
             "print(f'registry: {sys.argv[1]} inspected in {time.time() - start:.1f} s', flush=True)")


def warm_registry(lease: Lease, python: str) -> list[tuple[str, subprocess.Popen]]:
    if not lease.cuda and importlib.util.find_spec("vllm") is None:  # the node's vLLM is on the children's path
        return []
    return [(arch, subprocess.Popen([python, "-c", WARM_CODE, arch], cwd=ROOT, env=lease.env(), stdout=lease.log,
                                    stderr=subprocess.STDOUT, start_new_session=True))
            for arch in WARM_ARCHITECTURES]


def record_warm(lease: Lease, warming: list[tuple[str, subprocess.Popen]]) -> None:
    """Each background inspection's outcome (its seconds are in the log); one still running is stopped."""
    for arch, process in warming:
        code = process.poll()
        if code is None:
            stop_group(process)
        lease.record(f"registry:{arch}", {"status": "ok" if code == 0 else "timed out" if code is None else "failed",
                                          "returncode": code})


def imports_stage(lease: Lease, python: str) -> None:
    """The import check; on the GPU a passing one from an earlier call on this warm machine (the same unpacked
    bundle) is read back, not run again: it costs half a minute of the part."""
    target = lease.work / "imports.json"
    if lease.cuda and target.is_file() and not json.loads(target.read_text()).get("failed", True):
        lease.record("imports", {"status": "ok", "reused": str(target), **read_json(target)})
        return
    target.unlink(missing_ok=True)
    lease.run("imports", [python, str(Path(__file__)), "imports", "--json", str(target),
                          *(["--vllm"] if lease.cuda else [])], lambda: read_json(target))


# ---------------------------------------------------------------- helpers the stages run in their own process


def imports_main(args) -> int:
    """What imports, at which version (the node's image plus the bundle); a missing module named."""

    found, failed = {}, {}
    modules = ["torch", "transformers", "hydra", "omegaconf", "mlflow", "src.run"] + (["vllm"] if args.vllm else [])
    for module in modules:
        try:
            found[module] = str(getattr(importlib.import_module(module), "__version__", "ok"))
        except Exception as error:  # noqa: BLE001
            failed[module] = f"{type(error).__name__}: {error}"
    if args.vllm and "vllm" in found:
        try:
            from vllm import LLM  # noqa: F401  (the engine's own import path)
        except Exception as error:  # noqa: BLE001
            failed["vllm.LLM"] = f"{type(error).__name__}: {error}"
    import torch

    found["cuda"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    Path(args.json).write_text(json.dumps({"versions": found, "failed": failed}, indent=1))
    print(json.dumps({"versions": found, "failed": failed}, indent=1))
    return 1 if failed else 0


def metrics_main(args) -> int:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(args.store)
    runs = [run for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])]
    if not runs:
        raise SystemExit(f"no run in {args.store}")
    run = max(runs, key=lambda r: r.info.start_time)
    figures = {"run_id": run.info.run_id, "status": run.info.status, "time": {}, "budget": {}}

    def history(key: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]

    for key in sorted(k for k in run.data.metrics if k.startswith("time/")):
        figures["time"][key] = history(key)
    # The tokens beside the seconds: a phase's rate (generated tokens/s, the update's tokens/s) from the record.
    for key in ("budget/generated_tokens", "budget/trained_tokens"):
        if key in run.data.metrics:
            figures["budget"][key] = history(key)
    Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


# The rehearsal's 1.5B-shaped policy: heads of 32 dims, the smallest that vLLM's CPU attention lists
# (vllm/v1/attention/backends/cpu_attn.py, CPUAttentionBackend.get_supported_head_sizes); 16 was refused on a
# host without AVX-512 ("Unsupported CPU attention configuration: head_dim=16").
TINY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=4096)


def random_policy_main(args) -> int:
    """--preset's architecture (conf/policy/shapes) with random bf16 weights and a BPE tokenizer learnt here
    (`text_tokenizer`) over its vocabulary; --tiny: 2 narrow layers, a vocabulary of 4,096 (the CPU rehearsal)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from src.distributed.memory import shape_file

    shape = json.loads(shape_file(args.preset).read_text())
    if args.tiny:
        shape.update(TINY_SHAPE)
    config = AutoConfig.for_model(**shape)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder = Path(args.folder)
    model.save_pretrained(folder)
    text_tokenizer(config.vocab_size).save_pretrained(folder)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.3f} B random parameters in {folder}")
    return 0


def text_tokenizer(vocab_size: int, merges: int = 16_000):
    """A byte-level BPE learnt from the repository's own English (README.md, docs/*.md), then filler ids up to
    `vocab_size`. The node has no hub; one id a byte would make a countdown prompt 567 ids where a hub tokenizer
    merges whole words (benchmarks/results/README.md), and learnt merges give the task's prompts a hub
    tokenizer's order of length (150 ids), so a lease cell's step is timed on rows of a real run's length. Loaded back as
    the Qwen2 tokenizer that config.json's model type names; it decodes every id a random policy samples."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = [path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    learnt = Tokenizer(models.BPE())
    learnt.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size - 2, 256 + merges), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    learnt.train_from_iterator(text, trainer)
    model = json.loads(learnt.to_str())["model"]
    vocab = dict(model["vocab"])
    vocab.update({f"<|t{index}|>": index for index in range(len(vocab), vocab_size)})  # never produced by merges
    merged = [tuple(pair.split(" ")) if isinstance(pair, str) else tuple(pair) for pair in model["merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merged))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    filler = len(model["vocab"])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=f"<|t{filler}|>", eos_token=f"<|t{filler + 1}|>")


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


@functools.lru_cache(maxsize=1)
def _nvml():
    """The driver's NVML library, initialised once; None where there is none (a CPU machine)."""
    try:
        library = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    return library if library.nvmlInit_v2() == 0 else None


def nvml_used_gib(index: int = 0) -> float | None:
    """The used memory of GPU `index` (NVML's numbering: the lease node's one GPU is 0) in GiB, or None. NVML
    asks the driver, not a CUDA context, so a thread may call it while vLLM captures CUDA graphs."""
    library, handle, memory = _nvml(), ctypes.c_void_p(), _NvmlMemory()
    if library is None or library.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0 \
            or library.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0:
        return None
    return memory.used / 2**30


class MemoryPeaks:
    """The peaks a `peak` stage records in `path`, rewritten as they grow. A thread polls the whole device's used
    memory (vLLM's pool included) through NVML and the host's peak RSS: no CUDA call, since vLLM captures its CUDA
    graphs in global mode, where a CUDA call from another thread can break the capture. torch's allocator peaks
    are read once, on the main thread as the process exits."""

    def __init__(self, path: Path, device_used=nvml_used_gib) -> None:
        self.path, self.device_used = Path(path), device_used
        self.figures, self.lock = {"device_used_peak_gib": 0.0}, threading.Lock()

    def poll(self) -> None:
        import resource

        used = self.device_used()
        with self.lock:
            if used is not None:
                self.figures["device_used_peak_gib"] = max(self.figures["device_used_peak_gib"], used)
            self.figures["host_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text(json.dumps(self.figures, indent=1))
            os.replace(partial, self.path)  # a reader never sees half a file

    def at_exit(self) -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.figures["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            self.figures["max_memory_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        self.poll()

    def start(self, every_s: float = 0.5) -> None:
        def loop() -> None:
            while True:
                self.poll()
                time.sleep(every_s)

        threading.Thread(target=loop, daemon=True).start()


def peak_main(args) -> int:
    """`python -m MODULE ARGS` in this process, its memory peaks (`MemoryPeaks`) written to --json as it runs and
    at exit."""
    import atexit
    import runpy

    peaks = MemoryPeaks(Path(args.json))
    peaks.start()
    atexit.register(peaks.at_exit)
    module, *rest = args.command[1:] if args.command[:1] == ["--"] else args.command
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def positive_seconds(text: str) -> float:
    """--seconds: a part given no time would skip every stage and report them all as skipped."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r}: the part's limit in seconds, a number above 0 (e.g. --seconds 240)")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", type=int, choices=(1, 2), default=1)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--bundle", type=Path, default=ROOT / "gpu-bundle")
    parser.add_argument("--work", type=Path, default=None, help="default /tmp/rr-lease (cuda), OUT/work (cpu)")
    parser.add_argument("--seconds", type=positive_seconds, default=None, help="the part's limit (default: PART_SECONDS)")
    verbs = parser.add_subparsers(dest="verb")
    checked = verbs.add_parser("imports")
    checked.add_argument("--json", required=True)
    checked.add_argument("--vllm", action="store_true")
    read = verbs.add_parser("metrics")
    read.add_argument("--store", required=True)
    read.add_argument("--json", required=True)
    made = verbs.add_parser("random-policy")
    made.add_argument("--folder", required=True)
    made.add_argument("--preset", default=PRESET, help="the hub id whose architecture conf/policy/shapes holds")
    made.add_argument("--device", default="cpu")
    made.add_argument("--tiny", action="store_true")
    planned = verbs.add_parser("plan")
    planned.add_argument("--json", required=True)
    measured = verbs.add_parser("peak")
    measured.add_argument("--json", required=True)
    measured.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    helpers = {"imports": imports_main, "metrics": metrics_main, "random-policy": random_policy_main,
               "plan": plan_main, "peak": peak_main}
    if args.verb:
        return helpers[args.verb](args)
    if args.out is None:
        parser.error("--out DIR is needed: where partN.json and partN.log land (make gpu-lease OUT=DIR)")
    args.out = args.out.resolve()
    return lease_main(args)


if __name__ == "__main__":
    sys.exit(main())
