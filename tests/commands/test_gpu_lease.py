"""The GPU lease's bundle (launch/bundle.py) and preflight (launch/gpu_lease.py), on small fake inputs: nothing is
downloaded. The rehearsal test runs `make gpu-lease DEVICE=cpu OUT=...` as typed, both parts."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from launch import bundle, gpu_lease

ROOT = Path(__file__).resolve().parents[2]
ENV = {key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}


def write_wheel(folder: Path, name: str, files: dict[str, bytes], requires: tuple[str, ...] = ()) -> Path:
    """A wheel holding `files` and METADATA with `requires` (Requires-Dist lines)."""
    folder.mkdir(parents=True, exist_ok=True)
    metadata = (f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
                + "".join(f"Requires-Dist: {r}\n" for r in requires))
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
        archive.writestr(f"{name}-1.0.dist-info/METADATA", metadata)
    return wheel


def fake_bundle(tmp_path: Path, piece_bytes: int, carry_bytes: int, extras: dict | None = None) -> tuple[bytes, dict]:
    """A packed site of incompressible bytes (so it needs several pieces), split into tmp_path/bundle/carryN."""
    site = tmp_path / "site"
    (site / "probe").mkdir(parents=True)
    (site / "probe" / "__init__.py").write_text("VALUE = 42\n")
    (site / "probe" / "blob.bin").write_bytes(random.Random(0).randbytes(150_000))
    data = bundle.compress(bundle.tar_bytes(site))
    extras = {"update_reference.py": b"# x\n"} if extras is None else extras
    manifest = bundle.split(data, tmp_path / "bundle", piece_bytes, carry_bytes, extras)
    return data, manifest


def test_the_pieces_fit_their_carry_folders_and_join_back_to_the_pack(tmp_path):
    data, manifest = fake_bundle(tmp_path, piece_bytes=40_000, carry_bytes=100_000)
    carries = sorted((tmp_path / "bundle").glob("carry*"))
    assert len(carries) == len(manifest["carries"]) >= 2 and len(manifest["pieces"]) >= 4
    for folder in carries:
        assert sum(path.stat().st_size for path in folder.iterdir()) <= 100_000  # pieces, manifest and extras
        assert all(path.stat().st_size <= 40_000 for path in folder.glob(f"{bundle.PACK}.*"))
        assert (folder / "update_reference.py").read_bytes() == b"# x\n"
    joined, missing, _ = bundle.gather(carries)
    assert joined == data and missing == []
    site = tmp_path / "unpacked"
    bundle.extract(joined, site)
    assert (site / "probe" / "__init__.py").read_text() == "VALUE = 42\n"
    partial, missing, _ = bundle.gather(carries[:1])
    assert partial is None and missing == [name for group in manifest["carries"][1:] for name in group]
    first = carries[0] / manifest["carries"][0][0]
    first.write_bytes(b"?" + first.read_bytes()[1:])
    with pytest.raises(bundle.BundleError, match=f"piece {first} is damaged"):
        bundle.gather(carries)


def test_a_piece_larger_than_its_carry_folder_is_refused(tmp_path):
    with pytest.raises(bundle.BundleError, match="lower --piece-mib"):
        bundle.split(b"x" * 10, tmp_path, piece_bytes=200, carry_bytes=100)


def test_the_site_is_unpacked_like_pip_trimmed_and_packed_to_the_same_bytes_every_time(tmp_path):
    vllm = write_wheel(tmp_path / "wheels", "vllm", {
        "vllm/__init__.py": b"", "vllm/vllm-rs": b"binary", "vllm/_moe_C_stable_libtorch.abi3.so": b"moe",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3",
        "vllm/third_party/deep_gemm/include/a.hpp": b"h", "vllm/third_party/deep_gemm/_C.cpython-312-x.so": b"312",
        "vllm/third_party/deep_gemm/_C.cpython-311-x.so": b"311", "vllm-1.0.data/purelib/extra.py": b"x = 1\n",
        "vllm-1.0.data/scripts/vllm": b"#!/bin/sh\n"})
    site = tmp_path / "site"
    bundle.unpack_wheel(vllm, site)
    assert (site / "extra.py").read_text() == "x = 1\n" and not (site / "vllm-1.0.data").exists()
    removed = bundle.trim(site)
    assert sorted(removed) == ["vllm/_moe_C_stable_libtorch.abi3.so", "vllm/third_party/deep_gemm/_C.cpython-311-x.so",
                               "vllm/third_party/deep_gemm/include", "vllm/vllm-rs",
                               "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"]
    kept = sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file())
    assert {"vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/third_party/deep_gemm/_C.cpython-312-x.so"} <= set(kept)
    first = bundle.compress(bundle.tar_bytes(site))
    os.utime(site / "extra.py", (1, 1))  # a later build: other times on disk, the same bytes packed
    assert bundle.compress(bundle.tar_bytes(site)) == first


def test_a_requirement_nothing_covers_is_named_with_the_wheels_that_need_it(tmp_path):
    wheels = [write_wheel(tmp_path, "alpha", {}, ("numpy>=1", "beta", "gamma", "delta; python_version >= '3.10'",
                                                  "epsilon; extra == 'docs'", "zeta; python_version < '3.8'")),
              write_wheel(tmp_path, "beta", {}, ("Delta_Pkg", "numpy"))]
    gaps = bundle.uncovered(wheels, image={"numpy"}, omitted={"gamma"})
    assert gaps == {"delta": ["alpha"], "delta-pkg": ["beta"]}


def test_a_pin_that_a_bundled_wheel_rejects_is_named_unless_overridden_on_purpose(tmp_path):
    # The bundle once pinned apache-tvm-ffi 0.1.10 (vLLM's pin) where xgrammar needs >= 0.1.11: vLLM failed to import.
    wheels = [write_wheel(tmp_path, "engine", {}, ("ffi==0.1.10", "other>=2; python_version < '3.8'")),
              write_wheel(tmp_path, "grammar", {}, ("ffi>=0.1.11",)), write_wheel(tmp_path, "ffi", {})]
    pins = [("engine", "1.0"), ("grammar", "1.0"), ("ffi", "0.1.10"), ("other", "1.0")]
    assert bundle.mismatched(wheels, pins, overridden=set()) == ["grammar needs ffi>=0.1.11, the list pins 0.1.10"]
    pins[2] = ("ffi", "0.1.15.post2")
    assert bundle.mismatched(wheels, pins, overridden=set()) == ["engine needs ffi==0.1.10, the list pins 0.1.15.post2"]
    assert bundle.mismatched(wheels, pins, overridden={"ffi"}) == []
    assert "apache-tvm-ffi" in bundle.omitted_names(bundle.LIST, "override")


def test_the_list_is_exact_pins_and_its_omissions_are_read(tmp_path):
    listed = tmp_path / "list.txt"
    listed.write_text("# omit: Foo_Bar, baz (why)\nvllm==0.26.0  # the engine\n\nhydra-core==1.3.8\n")
    assert bundle.read_pins(listed) == [("vllm", "0.26.0"), ("hydra-core", "1.3.8")]
    assert bundle.omitted_names(listed) == {"foo-bar", "baz"}
    listed.write_text("vllm>=0.26\n")
    with pytest.raises(bundle.BundleError, match=r"list.txt:1: 'vllm>=0.26' is not `name==version`"):
        bundle.read_pins(listed)
    pins = bundle.read_pins(bundle.LIST)
    assert ("vllm", "0.26.0") in pins
    assert {"hydra-core", "omegaconf", "mlflow-skinny"} <= {bundle.canonical(n) for n, _ in pins}
    assert not {bundle.canonical(n) for n, _ in pins} & bundle.image_names()  # nothing the image has is carried


def lease_args(tmp_path: Path, bundle_folder: Path) -> argparse.Namespace:
    return argparse.Namespace(part=1, device="cuda", out=tmp_path / "out", bundle=bundle_folder,
                              work=tmp_path / "work", seconds=60)


def test_each_call_stashes_its_carry_folder_and_the_bundle_unpacks_once_all_are_in(tmp_path):
    fake_bundle(tmp_path, piece_bytes=40_000, carry_bytes=100_000)
    carried = tmp_path / "call" / "gpu-bundle"
    carried.mkdir(parents=True)
    (tmp_path / "bundle" / "carry1").rename(carried / "carry1")  # the first call brings carry1 alone
    lease = gpu_lease.Lease(lease_args(tmp_path, carried))
    assert gpu_lease.install(lease) is False
    stage = lease.summary["stages"]["install"]
    assert stage["status"] == "incomplete" and stage["carry next"] == ["gpu-bundle/carry2"]
    (carried / "carry1").rename(tmp_path / "gone")  # the next call's tree holds carry2 only
    (tmp_path / "bundle" / "carry2").rename(carried / "carry2")
    lease = gpu_lease.Lease(lease_args(tmp_path, carried))
    assert gpu_lease.install(lease) is True and lease.summary["stages"]["install"]["status"] == "ok"
    assert (tmp_path / "work" / "site" / "probe" / "__init__.py").is_file()
    assert str(tmp_path / "work" / "site") in lease.env()["PYTHONPATH"].split(os.pathsep)
    lease = gpu_lease.Lease(lease_args(tmp_path, tmp_path / "nothing-carried"))  # part 2, the machine still warm
    assert gpu_lease.install(lease) is True and "reused" in lease.summary["stages"]["install"]
    on_disk = json.loads((tmp_path / "out" / "part1.json").read_text())
    assert on_disk["stages"]["install"]["status"] == "ok"


def test_the_cpu_rehearsal_unpacks_the_bundle_but_keeps_it_off_its_stages_path(tmp_path):
    """The bundle's packages are built for the node's Python 3.12: on this Python a built bundle on the stages'
    path broke every stage of `make gpu-lease DEVICE=cpu` (pydantic_core's compiled module). The rehearsal still
    unpacks it, and its stages run on this Python's own packages."""
    fake_bundle(tmp_path, piece_bytes=40_000, carry_bytes=100_000)
    lease = gpu_lease.Lease(argparse.Namespace(**{**vars(lease_args(tmp_path, tmp_path / "bundle")), "device": "cpu"}))
    assert gpu_lease.install(lease) is True and (tmp_path / "work" / "site" / "probe" / "__init__.py").is_file()
    assert str(tmp_path / "work" / "site") not in lease.env()["PYTHONPATH"].split(os.pathsep)


def test_the_call_that_carries_the_first_pieces_only_stashes_them_and_part_1_reads_its_plain_loop_back(tmp_path):
    """Call 1 measures nothing (the plain loop is on record: no re-measure in a 15-minute window); a part 1 run
    again on the warm machine reads back the plain loop's figures of its first run."""
    script = b"import json, sys; json.dump({'results': [{'seconds': 1.5}]}, open(sys.argv[2], 'w'))\n"
    fake_bundle(tmp_path, piece_bytes=40_000, carry_bytes=100_000, extras={"update_reference.py": script})
    carried = tmp_path / "call" / "gpu-bundle"
    carried.mkdir(parents=True)
    (tmp_path / "bundle" / "carry1").rename(carried / "carry1")
    args = lease_args(tmp_path, carried)
    assert gpu_lease.lease_main(args) == 3  # incomplete
    stages = json.loads((tmp_path / "out" / "part1.json").read_text())["stages"]
    assert list(stages) == ["install"] and stages["install"]["status"] == "incomplete"
    lease = gpu_lease.Lease(args)
    gpu_lease.reference_stage(lease, sys.executable)  # part 1's first run
    assert lease.summary["stages"]["update_reference"]["figures"]["results"][0]["seconds"] == 1.5
    gpu_lease.reference_stage(lease, "python-not-run")  # part 1 again on the warm machine
    again = lease.summary["stages"]["update_reference"]
    assert "reused" in again and again["figures"]["results"][0]["seconds"] == 1.5


def test_a_passing_import_check_is_read_back_on_the_warm_machine_and_a_failing_one_runs_again(tmp_path):
    args = lease_args(tmp_path, tmp_path)
    lease = gpu_lease.Lease(args)
    lease.cuda = True  # the node's rule; the command below stands in for the import check
    target = tmp_path / "work" / "imports.json"
    target.write_text(json.dumps({"versions": {"vllm": "0.26.0"}, "failed": {}}))
    gpu_lease.imports_stage(lease, "python-not-run")
    stage = lease.summary["stages"]["imports"]
    assert stage["status"] == "ok" and "reused" in stage and stage["figures"]["versions"]["vllm"] == "0.26.0"
    target.write_text(json.dumps({"versions": {}, "failed": {"vllm": "ImportError: tvm_ffi"}}))
    lease = gpu_lease.Lease(args)
    lease.cuda = True
    gpu_lease.imports_stage(lease, "false")  # a Python that fails: the check ran again, not reused
    stage = lease.summary["stages"]["imports"]
    assert stage["status"] == "failed" and "reused" not in stage and not target.exists()


def test_a_stage_that_hangs_is_stopped_at_its_limit_and_the_next_one_runs(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_lease.LIMITS, "hang", 2)
    lease = gpu_lease.Lease(lease_args(tmp_path, tmp_path))
    hung = lease.run("hang", ["bash", "-c", "sleep 60 & sleep 60"])
    assert hung["status"] == "timed out" and hung["seconds"] < 20
    assert lease.run("after", ["bash", "-c", "exit 3"])["status"] == "failed"
    assert lease.run("fine", ["true"], lambda: {"figures": {"x": 1}})["figures"] == {"x": 1}
    assert set(json.loads((tmp_path / "out" / "part1.json").read_text())["stages"]) == {"hang", "after", "fine"}


def numbers(value) -> list[float]:
    if isinstance(value, dict):
        return [n for item in value.values() for n in numbers(item)]
    if isinstance(value, list):
        return [n for item in value for n in numbers(item)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


@pytest.mark.slow
@pytest.mark.parametrize("part, lease_py", [(1, None), (2, None),
                                            # in the vLLM suite, as docs/benchmarks.md types it with .venv-vllm
                                            pytest.param(2, sys.executable, marks=pytest.mark.vllm, id="2-vllm")])
def test_the_cpu_rehearsal_runs_every_stage_and_writes_its_figures(tmp_path, part, lease_py):
    # The install stage unpacks it. Part 1 finds update_reference.py in ../shared/bench, where the bundle carries
    # none; part 2's bundle carries the copy, which update_ops must read (shared/bench does not reach the node).
    carried = part == 2 and bundle.REFERENCE.is_file()
    fake_bundle(tmp_path, piece_bytes=100_000, carry_bytes=400_000,
                extras={"update_reference.py": bundle.REFERENCE.read_bytes()} if carried else {})
    out = tmp_path / "out"
    command = ["make", "gpu-lease", "DEVICE=cpu", f"OUT={out}", f"PART={part}", f"GPU_BUNDLE={tmp_path / 'bundle'}",
               *([f"LEASE_PY={lease_py}"] if lease_py else [])]
    # The node's image has no omegaconf, hydra or mlflow: only the stages' own processes get the bundle's. The
    # part's own process runs here with the three blocked, as there.
    blocked = tmp_path / "image-lacks"
    for module in ("omegaconf", "hydra", "mlflow"):
        (blocked / module).mkdir(parents=True)
        (blocked / module / "__init__.py").write_text(f"raise ImportError('{module}: not in the GPU image')\n")
    # A cap, not a speed target: a part took 5-10 minutes on 2 cores shared with other jobs (load average 12).
    done = subprocess.run(command, cwd=ROOT, env={**ENV, "PYTHONPATH": str(blocked)}, capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == [f"part{part}.json", f"part{part}.log"]
    stages = json.loads((out / f"part{part}.json").read_text())["stages"]
    assert stages["install"]["status"] == "ok" and stages["imports"]["status"] == "ok"
    if part == 1:
        assert stages["pytest"]["figures"]["counts"]["skipped"] == 3  # no CUDA here
        steps = stages["gpu_step"]["figures"]
        assert sorted(steps) == ["gpu_step_cpu_16_compile", "gpu_step_cpu_8_compile"]
        assert all(row["update_s"] > 0 for saved in steps.values() for row in saved["rows"])
        assert all(saved["args"]["compile"] == "True" for saved in steps.values())
        if bundle.REFERENCE.is_file():  # ../shared/bench beside the checkout
            assert stages["update_reference"]["figures"]["results"][0]["seconds"] > 0
        else:
            assert stages["update_reference"]["status"] == "missing"
    else:
        assert stages["update_ops"]["status"] == "ok"
        if carried:
            assert stages["update_ops"]["figures"]["reference_file"] == str(out / "work" / "pieces" /
                                                                            "update_reference.py")
        times = stages["torchrun"]["metrics"]["time"]
        assert len(times["time/train"]) == len(times["time/weight_sync"]) == 3 and min(times["time/train"]) > 0
        cell = stages["cell_0.5b"]  # a whole cell: FINISHED, each phase's time at each of its 3 steps, a checkpoint
        assert cell["status"] == "ok" and cell["metrics"]["status"] == "FINISHED" and cell["checkpoints"]
        assert all(len(cell["metrics"]["time"][key]) == 3 for key in ("time/step", "time/generate", "time/train"))
        generated = cell["metrics"]["budget"]["budget/generated_tokens"]  # cumulative: each step's rate follows
        assert len(generated) == 3 and 0 < generated[0] < generated[1] < generated[2]
        assert cell["figures"]["host_peak_rss_gib"] > 0
        preset = stages["preset_1.5b"]
        assert preset["status"] == "ok" and preset["figures"]["host_peak_rss_gib"] > 0
        assert preset["plan"]["training_gib"] > 0 and len(preset["metrics"]["time"]["time/train"]) == 1
        assert ("policy.engine=vllm" in (out / "part2.log").read_text()) == bool(lease_py)
    # vLLM's registry, inspected in the background per architecture so that no stage's engine waits for it
    warmed = {name: stage["status"] for name, stage in stages.items() if name.startswith("registry:")}
    assert warmed == ({f"registry:{arch}": "ok" for arch in gpu_lease.WARM_ARCHITECTURES} if lease_py else {})
    for name, stage in stages.items():
        assert stage["status"] in ("ok", "missing"), (name, stage)
        bare = name in ("install", "imports", "update_ops", "preset_1.5b:weights", "cell_0.5b:weights") or (
            name == "vllm_probe" and not lease_py)  # .venv has no vLLM: the probe is "missing" there
        assert bare or numbers(stage.get("figures", stage)), name
    assert not stages["imports"]["figures"]["failed"] and stages["imports"]["figures"]["versions"]["hydra"]


def test_the_peak_poller_reads_the_device_through_nvml_and_leaves_cuda_to_the_main_thread(tmp_path, monkeypatch):
    """A CUDA call from another thread can break vLLM's graph capture (global mode): the poller thread makes
    none, and torch's allocator peaks are read at exit, on the main thread."""
    import threading

    import torch

    main = threading.main_thread()

    def main_thread_only(value):
        def call(*args, **kwargs):
            assert threading.current_thread() is main, "a CUDA call from the poller's thread"
            return value
        return call

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", main_thread_only((2**30, 4 * 2**30)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", main_thread_only(2 * 2**30))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", main_thread_only(3 * 2**30))
    readings = iter([1.5, 2.5, 2.0])
    peaks = gpu_lease.MemoryPeaks(tmp_path / "peak.json", device_used=lambda: next(readings))
    for _ in range(3):
        poller = threading.Thread(target=peaks.poll)
        poller.start()
        poller.join()
    assert json.loads((tmp_path / "peak.json").read_text())["device_used_peak_gib"] == 2.5
    peaks.device_used = lambda: None  # no NVML (a CPU machine): the peak so far stays
    peaks.at_exit()
    figures = json.loads((tmp_path / "peak.json").read_text())
    assert figures["device_used_peak_gib"] == 2.5 and figures["max_memory_allocated_gib"] == 2.0
    assert figures["max_memory_reserved_gib"] == 3.0 and figures["host_peak_rss_gib"] > 0


def test_lease_seconds_bounds_a_part_as_typed(tmp_path):
    """`make gpu-lease ... LEASE_SECONDS=N` (docs/benchmarks.md, call 3): a part given no time skips every stage."""
    out = tmp_path / "out"
    command = ["make", "gpu-lease", "DEVICE=cpu", f"OUT={out}", "PART=1", "LEASE_SECONDS=1",
               f"GPU_BUNDLE={tmp_path / 'none'}"]
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    stages = json.loads((out / "part1.json").read_text())["stages"]
    assert {name: stage["status"] for name, stage in stages.items() if name != "install"} == {
        "imports": "skipped", "vllm_probe": "missing",  # .venv has no vLLM to probe, whatever the time
        "gpu_step": "skipped", "update_reference": "skipped", "pytest": "skipped"}


@pytest.mark.parametrize("seconds", ["abc", "0", "-5"])
def test_a_lease_limit_that_is_no_positive_number_is_one_line_before_any_stage(tmp_path, seconds):
    """As typed (docs/benchmarks.md, call 3), and the script's own flag: nothing runs, no stage is skipped silently."""
    out = tmp_path / "out"
    done = subprocess.run(["make", "gpu-lease", "DEVICE=cpu", f"OUT={out}", f"LEASE_SECONDS={seconds}"], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and not out.exists(), done.stdout + done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "LEASE_SECONDS" in line]
    assert f"LEASE_SECONDS={seconds}: the part's limit in seconds, a whole number of 1 or more" in line, line
    with pytest.raises(SystemExit) as refused:
        gpu_lease.main(["--device", "cpu", "--out", str(out), "--seconds", seconds])
    assert refused.value.code == 2 and not out.exists()


@pytest.mark.vllm
def test_the_rehearsals_tiny_preset_has_heads_that_vllms_cpu_attention_lists():
    """The CPU rehearsal under LEASE_PY=.venv-vllm/bin/python starts vLLM on this policy: a head size its CPU
    attention lacks stops part 2's 1.5B stage on some hosts only (16 did, on one without AVX-512)."""
    cpu_attention = pytest.importorskip("vllm.v1.attention.backends.cpu_attn", reason="vLLM is in .venv-vllm only")
    shape = gpu_lease.TINY_SHAPE
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    assert head_dim in cpu_attention.CPUAttentionBackend.get_supported_head_sizes()


def test_the_lease_policys_tokenizer_reads_a_prompt_in_words_and_decodes_it_back():
    """The node has no hub: the random policy's tokenizer is a BPE learnt from the repository's docs, so the task's
    prompts take about as many ids as a hub tokenizer gives them (one id a byte made a countdown prompt 567 ids,
    and the lease's cell step twice as long as the same batch's at a real length). Its last ids are fillers that
    no merge produces; pad and end of sequence are two of them."""
    from src.task.countdown import Instance, format_prompt

    prompt = format_prompt(Instance(numbers=(3, 25, 7, 50), target=81))
    for vocab_size in (4096, 151_936):  # the rehearsal's tiny vocabulary and Qwen2.5's
        tokenizer = gpu_lease.text_tokenizer(vocab_size)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert len(tokenizer) == vocab_size and max(ids) < vocab_size
        assert len(ids) < len(prompt.encode()) / 3, (vocab_size, len(ids))
        assert tokenizer.decode(ids) == prompt
        assert {tokenizer.pad_token_id, tokenizer.eos_token_id}.isdisjoint(ids)
        assert tokenizer.eos_token_id == tokenizer.pad_token_id + 1 < vocab_size
