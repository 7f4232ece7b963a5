"""launch/wheelhouse.py: the offline install kit for a GPU node, without the network (a wheel written here)."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from launch import wheelhouse


def write_wheel(folder: Path, name: str = "tinypkg", version: str = "0.1") -> Path:
    """A pure-Python wheel with a module that knows its version, RECORD hashes and all."""
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{name}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n"}
    record = f"{name}-{version}.dist-info/RECORD"
    lines = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        lines.append(f"{path},sha256={digest},{len(text.encode())}")
    files[record] = "\n".join([*lines, f"{record},,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def test_the_node_keeps_what_it_has_and_gets_the_rest():
    pins = wheelhouse.node_pins(["torch==2.11.0+cu130", "Transformers==5.17.0", "# comment", "-e git+x#egg=y"])
    assert pins == {"torch": "2.11.0", "transformers": "5.17.0"}  # local labels dropped for the index
    report = {"install": [{"metadata": {"name": name, "version": version}} for name, version in
                          (("vllm", "0.26.0"), ("torch", "2.11.0"), ("transformers", "5.18.0"), ("xgrammar", "0.1.2"))]}
    assert wheelhouse.missing_on_node(report, pins) == ["transformers==5.18.0", "vllm==0.26.0", "xgrammar==0.1.2"]
    command = wheelhouse.download_command(["vllm==0.26.0"], "3.12", Path("d"))
    assert "--no-deps" in command and command[command.index("--python-version") + 1] == "3.12"
    assert "--dry-run" in wheelhouse.resolve_command("vllm==0.26.0", "3.12", None)


def test_pieces_join_check_and_install_offline_into_a_fresh_venv(tmp_path):
    write_wheel(tmp_path / "download")
    (tmp_path / "download" / "padding-0.1-py3-none-any.whl").write_bytes(b"x" * 50_000)  # more than one piece
    manifest = wheelhouse.pack(tmp_path / "download", tmp_path / "kit", "tinypkg==0.1", piece_bytes=20_000)
    assert len(manifest["pieces"]) >= 3 and all(p["bytes"] <= 20_000 for p in manifest["pieces"])
    (tmp_path / "download" / "padding-0.1-py3-none-any.whl").unlink()
    target = tmp_path / "node"
    venv.create(target, with_pip=True)  # pip from the standard library's bundle: no network
    python = target / "bin" / "python"
    assert wheelhouse.main(["install", str(tmp_path / "kit"), "--python-exe", str(python)]) == 0
    done = subprocess.run([str(python), "-c", "import tinypkg; print(tinypkg.VERSION)"], capture_output=True, text=True)
    assert done.stdout.strip() == "0.1"


def test_a_damaged_or_missing_piece_is_named_before_anything_is_installed(tmp_path, capsys):
    write_wheel(tmp_path / "download")
    manifest = wheelhouse.pack(tmp_path / "download", tmp_path / "kit", "tinypkg==0.1", piece_bytes=1_000)
    second = tmp_path / "kit" / manifest["pieces"][1]["name"]
    second.write_bytes(b"?" + second.read_bytes()[1:])
    assert wheelhouse.main(["install", str(tmp_path / "kit"), "--python-exe", "/nonexistent/python"]) == 2
    assert f"piece {second.name} is damaged" in capsys.readouterr().err
    second.unlink()
    assert wheelhouse.main(["install", str(tmp_path / "kit")]) == 2
    assert f"piece {second.name} is missing" in capsys.readouterr().err
    assert json.loads((tmp_path / "kit" / "manifest.json").read_text())["requirement"] == "tinypkg==0.1"
    assert not (tmp_path / "kit" / "wheels").exists()


@pytest.mark.parametrize("verb", ["build", "install"])
def test_the_command_line_explains_itself(verb):
    done = subprocess.run([sys.executable, "launch/wheelhouse.py", verb, "--help"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and ("--node-freeze" in done.stdout if verb == "build" else "folder" in done.stdout)
