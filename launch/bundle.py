"""The GPU node's bundle (`make gpu-bundle`): what the lent node's image lacks, to carry there without network.

Built here, on any machine that reaches PyPI (nothing is resolved on the node):

    python launch/bundle.py build --out gpu-bundle          # make gpu-bundle (resumable: wheels present are kept)

1. downloads each wheel of launch/gpu-bundle.txt (exact `name==version` pins, `pip download --no-deps` for
   CPython 3.12 on manylinux x86_64); an sdist-only pure-Python package (antlr4-python3-runtime) is built
   into a wheel here;
2. unpacks the wheels into one `site/` folder (what `pip install --target` would lay out), then trims vLLM as
   benchmarks/results/README.md describes (TRIM: the FlashAttention-2 library, FA3 serves Hopper; the
   `vllm-rs` binary; the MoE kernels; the DeepGEMM and SM100 headers; DeepGEMM's builds for other Pythons);
3. packs `site/` as one xz tar, byte for byte the same on every build (sorted names, fixed times and
   owners, xz blocks of a fixed size), cuts it into pieces and groups the pieces into carry folders
   (`carry1/`, `carry2/`, ...) of at most --carry-mib each, so one device call carries the repo plus one
   carry folder under the 64 MiB a call may carry. Each carry folder holds `manifest.json` (sha256 of
   every piece and of the whole) and a copy of the plain loop update_reference.py (shared/bench beside the checkout), which does not travel
   with the repo.

On the node, launch/gpu_lease.py stashes the pieces each call brings into /tmp and unpacks the tar onto a
PYTHONPATH folder once all are there (`install`). The list's derivation is in launch/gpu-bundle.txt; `check`
names any requirement of a bundled wheel that neither the bundle, the image (launch/gpu-image.txt) nor the
list's deliberate omissions cover.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIST = HERE / "gpu-bundle.txt"
IMAGE = HERE / "gpu-image.txt"
REFERENCE = HERE.parent.parent / "shared" / "bench" / "update_reference.py"
PACK = "site.tar.xz"
MANIFEST = "manifest.json"
MIB = 2 ** 20
CALL_BYTES = 64 * MIB  # what one device call may carry: the repo's tree plus the carried folders
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64"]
# Paths under site/ left out of the bundle (benchmarks/results/README.md, "How vLLM reached a node"), and data
# files the node's runs never read.
TRIM = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs", "vllm/_moe_C*.so",
        "vllm/third_party/deep_gemm/include", "vllm/third_party/fmha_sm100",
        "vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so",
        "mistral_common/data/tekken_*.json", "pycountry/locales")  # Mistral's tokenizers, country-name translations
EPOCH = 1767225600  # 2026-01-01: every member's time, so the tar does not depend on when it was built
XZ_BLOCK = 16 * MIB  # fixed xz blocks: the same bytes whatever the thread count, and parallel unpacking


class BundleError(RuntimeError):
    """One line: what is wrong and what to do."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> list[tuple[str, str]]:
    """(name, version) of each `name==version` line; comments and blank lines skipped."""
    pins = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
        if not match:
            raise BundleError(f"{path}:{number}: {line!r} is not `name==version`: pin every wheel exactly")
        pins.append((match.group(1), match.group(2)))
    return pins


def wheel_present(folder: Path, name: str, version: str) -> Path | None:
    """The wheel of name==version already in `folder` (wheel file names use the underscore form)."""
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for wheel in sorted(folder.glob("*.whl")):
        parts = wheel.name.split("-")
        if len(parts) >= 2 and parts[0].lower().replace(".", "_") == stem and parts[1] == version:
            return wheel
    return None


def download(pins: list[tuple[str, str]], folder: Path, python: str = "3.12") -> None:
    """Each pinned wheel into `folder`, those already there skipped; a pure-Python sdist is built into a wheel."""
    folder.mkdir(parents=True, exist_ok=True)
    wanted = [f"{name}=={version}" for name, version in pins if wheel_present(folder, name, version) is None]
    if not wanted:
        return
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               python, "--implementation", "cp", "--dest", str(folder)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    if subprocess.run(command + wanted).returncode == 0:
        return
    for requirement in wanted:  # one at a time: which failed, and build the sdist-only ones
        if subprocess.run(command + [requirement]).returncode == 0:
            continue
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(folder), requirement])
        if built.returncode != 0:
            raise BundleError(f"{requirement}: no wheel for CPython {python} on manylinux x86_64 and no sdist "
                              f"that builds; change its pin in {LIST.name}")


def unpack_wheel(wheel: Path, site: Path) -> None:
    """A wheel's files as `pip install --target` lays them out: its *.data/purelib and platlib at the top,
    its scripts, headers and data left out (nothing on the node runs them)."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            name = member.filename
            data = re.match(r"^[^/]+\.data/(purelib|platlib|scripts|headers|data)/(.*)$", name)
            if data:
                if data.group(1) not in ("purelib", "platlib"):
                    continue
                name = data.group(2)
            if member.is_dir() or not name or name.startswith("/") or ".." in Path(name).parts:
                continue
            target = site / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(member))
            if member.external_attr >> 16 & 0o111:
                target.chmod(0o755)


def trim(site: Path, patterns=TRIM) -> dict[str, int]:
    """Remove what the node's runs never load; {path: bytes removed}."""
    removed = {}
    for pattern in patterns:
        for path in sorted(site.glob(pattern)):
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            removed[str(path.relative_to(site))] = sum(p.stat().st_size for p in files)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return removed


def tar_bytes(site: Path) -> bytes:
    """`site/` as an uncompressed tar with sorted names, one time and no owners: the same bytes every build."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for path in sorted(site.rglob("*"), key=lambda p: p.relative_to(site).as_posix()):
            info = archive.gettarinfo(str(path), arcname=path.relative_to(site).as_posix())
            info.mtime, info.uid, info.gid, info.uname, info.gname = EPOCH, 0, 0, "", ""
            info.mode = 0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644
            if info.isreg():
                with path.open("rb") as handle:
                    archive.addfile(info, handle)
            elif info.isdir():
                archive.addfile(info)
    return buffer.getvalue()


def compress(data: bytes) -> bytes:
    """xz with fixed blocks (the xz tool, threaded, where there is one; Python's lzma otherwise, one block)."""
    if shutil.which("xz"):
        done = subprocess.run(["xz", "-6", "-T0", f"--block-size={XZ_BLOCK}", "-c"], input=data,
                              capture_output=True, check=True)
        return done.stdout
    return lzma.compress(data, preset=6)


def split(data: bytes, out: Path, piece_bytes: int, carry_bytes: int, extras: dict[str, bytes] | None = None) -> dict:
    """`data` cut into pieces of at most piece_bytes, grouped in order into carry folders of at most carry_bytes
    (pieces plus the manifest and `extras`, copied into every carry folder); returns the manifest."""
    if piece_bytes > carry_bytes:
        raise BundleError(f"pieces of {piece_bytes} bytes cannot fit carry folders of {carry_bytes}: lower --piece-mib")
    out.mkdir(parents=True, exist_ok=True)
    pieces = [{"name": f"{PACK}.{i:03d}", "bytes": len(data[s:s + piece_bytes]),
               "sha256": hashlib.sha256(data[s:s + piece_bytes]).hexdigest(), "start": s}
              for i, s in enumerate(range(0, len(data), piece_bytes))]
    overhead = 8192 + sum(len(blob) for blob in (extras or {}).values())  # the manifest, the copied files
    carries, current = [], []
    for piece in pieces:
        if current and sum(p["bytes"] for p in current) + piece["bytes"] + overhead > carry_bytes:
            carries.append(current)
            current = []
        current.append(piece)
    carries.append(current)
    manifest = {"pack": PACK, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                "carries": [[p["name"] for p in group] for group in carries],
                "pieces": [{k: v for k, v in p.items() if k != "start"} for p in pieces]}
    for old in out.glob("carry*"):
        shutil.rmtree(old)
    for number, group in enumerate(carries, 1):
        folder = out / f"carry{number}"
        folder.mkdir()
        for piece in group:
            (folder / piece["name"]).write_bytes(data[piece["start"]:piece["start"] + piece["bytes"]])
        for name, blob in (extras or {}).items():
            (folder / name).write_bytes(blob)
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def gather(folders: list[Path]) -> tuple[bytes | None, list[str], dict]:
    """The pack joined from the pieces found in `folders` (the first holding a manifest decides), each piece
    checked; (None, the missing pieces' names, manifest) while some are missing."""
    manifests = [f / MANIFEST for f in folders if (f / MANIFEST).is_file()]
    if not manifests:
        raise BundleError(f"no {MANIFEST} in {', '.join(map(str, folders))}: carry a gpu-bundle/carryN folder")
    manifest = json.loads(manifests[0].read_text())
    chunks, missing = [], []
    for piece in manifest["pieces"]:
        found = next((f / piece["name"] for f in folders if (f / piece["name"]).is_file()), None)
        if found is None:
            missing.append(piece["name"])
            continue
        chunk = found.read_bytes()
        if hashlib.sha256(chunk).hexdigest() != piece["sha256"]:
            raise BundleError(f"piece {found} is damaged (sha256 differs from {MANIFEST}): carry it again")
        chunks.append(chunk)
    if missing:
        return None, missing, manifest
    data = b"".join(chunks)
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise BundleError(f"the joined pieces differ from {MANIFEST}'s sha256: rebuild with make gpu-bundle")
    return data, [], manifest


def extract(data: bytes, site: Path) -> None:
    """The packed folder unpacked into `site` (xz -d threaded where the tool is there)."""
    if shutil.which("xz"):
        raw = subprocess.run(["xz", "-dc", "-T0"], input=data, capture_output=True, check=True).stdout
    else:
        raw = lzma.decompress(data)
    site.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(raw)) as archive:
        archive.extractall(site, filter="data")


def requirements_of(wheel: Path) -> list:
    """A wheel's unconditional requirements on Linux x86_64 under CPython 3.12 (extras left out), as
    `packaging` Requirements."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    environment = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
                   "platform_machine": "x86_64", "sys_platform": "linux", "platform_system": "Linux", "extra": ""}
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if re.match(r"^[^/]+\.dist-info/METADATA$", n))
        lines = archive.read(metadata).decode("utf-8", "replace").splitlines()
    found = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.marker is None or requirement.marker.evaluate(environment):
                found.append(requirement)
    return found


def uncovered(wheels: list[Path], image: set[str], omitted: set[str]) -> dict[str, list[str]]:
    """{requirement: [wheels that need it]} for each one neither bundled, on the image nor deliberately omitted."""
    bundled = {canonical(w.name.split("-")[0]) for w in wheels}
    gaps: dict[str, list[str]] = {}
    for wheel in wheels:
        for name in (canonical(r.name) for r in requirements_of(wheel)):
            if name not in bundled | image | omitted:
                gaps.setdefault(name, []).append(wheel.name.split("-")[0])
    return gaps


def mismatched(wheels: list[Path], pins: list[tuple[str, str]], overridden: set[str]) -> list[str]:
    """Each bundled wheel's requirement that the pinned version of a bundled package does not satisfy, unless the
    list overrides that package on purpose (`# override: name (why)`): on the node the first import finds out."""
    pinned = {canonical(name): version for name, version in pins}
    found = []
    for wheel in wheels:
        for requirement in requirements_of(wheel):
            name = canonical(requirement.name)
            if name in pinned and name not in overridden and not requirement.specifier.contains(pinned[name], True):
                found.append(f"{wheel.name.split('-')[0]} needs {requirement.name}{requirement.specifier}, "
                             f"the list pins {pinned[name]}")
    return found


def image_names(path: Path = IMAGE) -> set[str]:
    return {canonical(line.split("==")[0].strip()) for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def omitted_names(path: Path = LIST, word: str = "omit") -> set[str]:
    """The `# omit: name, name` lines of the list: requirements left out on purpose (the reason beside them);
    with word="override", the `# override:` lines: packages pinned against a requirement on purpose."""
    names, prefix = set(), f"# {word}:"
    for line in path.read_text().splitlines():
        if line.startswith(prefix):
            names |= {canonical(n) for n in line[len(prefix):].split("(")[0].replace(",", " ").split()}
    return names


def tree_bytes(root: Path = HERE.parent) -> int:
    """What a device call sends besides the carried folders: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True)
    return sum((root / name).stat().st_size for name in listed.stdout.split("\0") if name and (root / name).is_file())


def build(args) -> None:
    pins = read_pins(args.list)
    wheels_dir, site = args.out / "wheels", args.out / "site"
    download(pins, wheels_dir, args.python)
    wheels = [wheel_present(wheels_dir, name, version) for name, version in pins]
    conflicts = mismatched(wheels, pins, omitted_names(args.list, "override"))
    if conflicts:
        raise BundleError(f"{args.list}: {'; '.join(conflicts)}: pin a version that satisfies them, or declare the "
                          "package on a `# override: name (why)` line")
    gaps = uncovered(wheels, image_names(args.image), omitted_names(args.list))
    for name, needers in sorted(gaps.items()):
        print(f"warning: {name} (needed by {', '.join(needers)}) is neither bundled, on the image nor omitted "
              f"on purpose in {args.list.name}", file=sys.stderr)
    if site.exists():
        shutil.rmtree(site)
    for wheel in wheels:
        unpack_wheel(wheel, site)
    removed = trim(site)
    data = compress(tar_bytes(site))
    extras = {"update_reference.py": REFERENCE.read_bytes()} if REFERENCE.is_file() else {}
    manifest = split(data, args.out, int(args.piece_mib * MIB), int(args.carry_mib * MIB), extras)
    summary = {"wheels": [w.name for w in wheels], "trimmed": removed, "uncovered": gaps, **manifest}
    (args.out / "build.json").write_text(json.dumps(summary, indent=1))
    tree = tree_bytes()
    for number, group in enumerate(manifest["carries"], 1):
        size = sum(path.stat().st_size for path in (args.out / f"carry{number}").iterdir())
        print(f"carry{number}: {len(group)} piece(s), {size / MIB:.1f} MiB; with the repo's {tree / MIB:.1f} MiB, "
              f"{(size + tree) / MIB:.1f} MiB a call")
        if size + tree > CALL_BYTES:
            print(f"warning: carry{number} and the repo exceed the {CALL_BYTES // MIB} MiB a device call carries: "
                  f"lower --carry-mib", file=sys.stderr)
    print(f"{len(wheels)} wheels, {sum(removed.values()) / MIB:.0f} MiB trimmed, {len(data) / MIB:.1f} MiB packed in "
          f"{args.out}; carry one gpu-bundle/carryN folder a device call (docs/benchmarks.md, 'A GPU lease')")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    made = verbs.add_parser("build", help="download, unpack, trim, pack and split (needs PyPI)")
    made.add_argument("--out", type=Path, default=Path("gpu-bundle"))
    made.add_argument("--list", type=Path, default=LIST, help="the pinned wheels")
    made.add_argument("--image", type=Path, default=IMAGE, help="the node image's package names")
    made.add_argument("--python", default="3.12", help="the node's Python version")
    made.add_argument("--piece-mib", type=float, default=8.0)
    made.add_argument("--carry-mib", type=float, default=52.0,
                      help="at most this per carry folder: the repo (~10 MiB) and one folder stay under 64 MiB")
    args = parser.parse_args(argv)
    try:
        build(args)
    except BundleError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
