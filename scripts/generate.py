"""Generate the Python protobuf and gRPC code in ``generated/`` from ``proto/``.

The one way ``generated/`` is made (docs/architecture.md). It pins grpcio-tools and
mypy-protobuf exactly, so everyone produces byte-identical output; ``--check`` regenerates
into a temporary folder and fails when the committed tree differs (a stale ``generated/``
fails CI).

The google.rpc and google.api protos under ``third_party/`` are imported but never
generated: Python takes them from googleapis-common-protos.

Usage: ``python scripts/generate.py [--check]``
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
THIRD_PARTY = ROOT / "third_party"
OUT = ROOT / "generated"
PINNED = {"grpcio-tools": "1.85.1", "mypy-protobuf": "5.1.0"}


def _check_pins() -> None:
    for package, version in PINNED.items():
        found = importlib.metadata.version(package)
        if found != version:
            sys.exit(f"generate: {package} {version} is pinned, {found} is installed")


def generate(out: Path) -> None:
    """Write the generated tree for every ``.proto`` under ``proto/`` into ``out``."""
    import grpc_tools

    protos = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    plugins: dict[str, str] = {}
    for name in ("protoc-gen-mypy", "protoc-gen-mypy_grpc"):
        found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
        if found is None:
            sys.exit(f"generate: {name} (mypy-protobuf) not found")
        plugins[name] = found
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{THIRD_PARTY}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--mypy_out={out}",
        f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-mypy={plugins['protoc-gen-mypy']}",
        f"--plugin=protoc-gen-mypy_grpc={plugins['protoc-gen-mypy_grpc']}",
        f"--mypy_grpc_out={out}",
        *protos,
    ]
    subprocess.run(command, check=True, cwd=ROOT)
    # Packages need __init__.py for setuptools and mypy; empty files, made here, not by hand.
    for directory in [out / "ballet", *(p for p in (out / "ballet").rglob("*") if p.is_dir())]:
        (directory / "__init__.py").touch()
        (directory / "py.typed").touch()


def _differences(a: Path, b: Path) -> list[str]:
    found: list[str] = []
    comparison = filecmp.dircmp(a, b, ignore=["__pycache__"])

    def walk(c: filecmp.dircmp[str], prefix: str) -> None:
        found.extend(f"{prefix}{n} (only in committed tree)" for n in c.left_only)
        found.extend(f"{prefix}{n} (missing from committed tree)" for n in c.right_only)
        _, mismatch, errors = filecmp.cmpfiles(c.left, c.right, c.common_files, shallow=False)
        found.extend(f"{prefix}{n} (differs)" for n in mismatch + errors)
        for name, sub in c.subdirs.items():
            walk(sub, f"{prefix}{name}/")

    walk(comparison, "")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if generated/ is stale")
    args = parser.parse_args()
    _check_pins()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = Path(tmp) / "generated"
            generate(fresh)
            stale = _differences(OUT, fresh) if OUT.exists() else ["generated/ is missing"]
        if stale:
            print("generated/ is stale; run `python scripts/generate.py`:", *stale, sep="\n  ")
            return 1
        print("generated/ is up to date")
        return 0
    if OUT.exists():
        shutil.rmtree(OUT)
    generate(OUT)
    print(f"generated {sum(1 for _ in OUT.rglob('*.py'))} Python files into generated/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
