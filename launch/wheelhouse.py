"""A wheelhouse for a GPU node without network: vLLM's CUDA wheels and whatever else the node's Python lacks,
packed in pieces small enough to carry (60 MiB each by default), installed there with `pip --no-index`.

On a machine with network (any OS: pip resolves for the node's Python and platform):

    python launch/wheelhouse.py build --vllm 0.26.0 --node-freeze node-freeze.txt --out wheelhouse
    make wheelhouse VLLM=0.26.0 NODE_FREEZE=node-freeze.txt          # the same

`node-freeze.txt` is `pip freeze` run on the node: what it lists (its torch, transformers, CUDA
libraries) pins the resolution and is not downloaded. pip resolves from the index's metadata
(`pip install --dry-run --report`), so the node's torch is never fetched. On the node, with the
pieces copied into one folder:

    python wheelhouse.py install wheelhouse       # checks every piece, joins them, pip install --no-index

Every piece and the whole pack carry a sha256 in `manifest.json`; a missing or damaged piece is named
in one line before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
PACK = "wheelhouse.tar"
MANIFEST = "manifest.json"


class WheelhouseError(RuntimeError):
    """One line: what is wrong and what to do."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def node_pins(freeze_lines: list[str]) -> dict[str, str]:
    """name -> version of what the node has (`pip freeze`), local labels (+cu130) dropped for the index."""
    pins = {}
    for line in freeze_lines:
        match = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#+]+)", line)
        if match:
            pins[canonical(match.group(1))] = match.group(2)
    return pins


def resolve_command(requirement: str, python: str, constraints: Path | None) -> list[str]:
    """pip's resolution for the node, from the index's metadata only (nothing is downloaded or installed)."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", "--ignore-installed",
               "--only-binary=:all:", "--python-version", python, "--target", "/nonexistent-wheelhouse-target"]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    return command + (["-c", str(constraints)] if constraints else []) + [requirement]


def missing_on_node(report: dict, pins: dict[str, str]) -> list[str]:
    """`name==version` of each package the resolution installs that the node does not already have."""
    wanted = []
    for item in report.get("install", []):
        metadata = item["metadata"]
        name, version = canonical(metadata["name"]), metadata["version"]
        if pins.get(name) != version:
            wanted.append(f"{name}=={version}")
    return sorted(wanted)


def download_command(pins: list[str], python: str, dest: Path) -> list[str]:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
               "--dest", str(dest)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    return command + pins


def pack(wheels: Path, out: Path, requirement: str, piece_bytes: int) -> dict:
    """One uncompressed tar of the wheels (they are zip files already), cut into pieces, and its manifest."""
    out.mkdir(parents=True, exist_ok=True)
    whole = out / PACK
    with tarfile.open(whole, "w") as archive:
        for wheel in sorted(wheels.glob("*.whl")):
            archive.add(wheel, arcname=wheel.name)
    data, pieces = whole.read_bytes(), []
    for index, start in enumerate(range(0, len(data), piece_bytes)):
        chunk = data[start:start + piece_bytes]
        name = f"{PACK}.{index:03d}"
        (out / name).write_bytes(chunk)
        pieces.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    whole.unlink()
    manifest = {"requirement": requirement, "sha256": hashlib.sha256(data).hexdigest(), "pieces": pieces,
                "wheels": sorted(wheel.name for wheel in wheels.glob("*.whl"))}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def unpack(folder: Path) -> tuple[Path, dict]:
    """The wheels folder rebuilt from the pieces, each checked against the manifest first."""
    if not (folder / MANIFEST).is_file():
        raise WheelhouseError(f"{folder / MANIFEST} is missing: copy the whole wheelhouse folder (pieces and manifest)")
    manifest = json.loads((folder / MANIFEST).read_text())
    data = bytearray()
    for piece in manifest["pieces"]:
        path = folder / piece["name"]
        if not path.is_file():
            raise WheelhouseError(f"piece {piece['name']} is missing from {folder}: copy it again")
        chunk = path.read_bytes()
        if hashlib.sha256(chunk).hexdigest() != piece["sha256"]:
            raise WheelhouseError(f"piece {piece['name']} is damaged (sha256 differs from {MANIFEST}): copy it again")
        data += chunk
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise WheelhouseError(f"the joined pieces differ from {MANIFEST}'s sha256: copy the folder again")
    (folder / PACK).write_bytes(bytes(data))
    wheels = folder / "wheels"
    with tarfile.open(folder / PACK) as archive:
        archive.extractall(wheels, filter="data")  # wheels only: no links, no paths outside the folder
    (folder / PACK).unlink()
    return wheels, manifest


def build(args) -> None:
    pins = node_pins(Path(args.node_freeze).read_text().splitlines()) if args.node_freeze else {}
    constraints = args.out / "node-constraints.txt"
    args.out.mkdir(parents=True, exist_ok=True)
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    requirement = f"vllm=={args.vllm}"
    resolved = subprocess.run(resolve_command(requirement, args.python, constraints), capture_output=True, text=True)
    if resolved.returncode != 0:
        raise WheelhouseError(f"pip could not resolve {requirement} for Python {args.python} with the node's pins: "
                              f"{(resolved.stderr.strip().splitlines() or ['?'])[-1]}")
    wanted = missing_on_node(json.loads(resolved.stdout), pins)
    wheels = args.out / "download"
    subprocess.run(download_command(wanted, args.python, wheels), check=True)
    manifest = pack(wheels, args.out, requirement, int(args.piece_mib * 2**20))
    print(f"{len(manifest['wheels'])} wheels in {len(manifest['pieces'])} pieces of at most {args.piece_mib:g} MiB "
          f"in {args.out}; on the node: python wheelhouse.py install <folder>")


def install(args) -> None:
    wheels, manifest = unpack(args.folder)
    subprocess.run([args.python_exe, "-m", "pip", "install", "--no-index", "--find-links", str(wheels),
                    manifest["requirement"]], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    made = verbs.add_parser("build", help="resolve, download and pack (needs network)")
    made.add_argument("--vllm", default="0.26.0", help="the vLLM release (the node's torch decides which fits)")
    made.add_argument("--python", default="3.12", help="the node's Python version")
    made.add_argument("--node-freeze", help="`pip freeze` of the node: kept, not downloaded")
    made.add_argument("--out", type=Path, default=Path("wheelhouse"))
    made.add_argument("--piece-mib", type=float, default=60.0)
    put = verbs.add_parser("install", help="check, join and pip install --no-index (no network)")
    put.add_argument("folder", type=Path)
    put.add_argument("--python-exe", default=sys.executable, help="the Python to install into")
    args = parser.parse_args(argv)
    try:
        build(args) if args.verb == "build" else install(args)
    except WheelhouseError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
