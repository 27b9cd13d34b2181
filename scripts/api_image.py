"""Write the committed image of the API, the baseline of ``buf breaking``.

``buf breaking`` compares the protos under ``proto/`` with ``api/image.json``, an image
built by this script (``buf build proto``, no source info). The image changes only when
someone runs this script on purpose, typically when a release's API is final; the change
shows in review as a JSON diff. Until then every proto change is checked against it
(AIP-180: additions only). CI runs ``buf breaking proto --against api/image.json``.

The JSON is indented so a diff shows the fields that changed.

Usage: ``python scripts/api_image.py [--check]``; ``--check`` runs the breaking check
instead of writing the image. buf comes from PATH or from ``.venv/buf`` (where
``.ci/run`` installs it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGE = ROOT / "api" / "image.json"


def find_buf() -> str:
    """The buf CLI; exits with a message when it is not installed."""
    local = ROOT / ".venv" / "buf" / "node_modules" / ".bin" / "buf"
    found = shutil.which("buf") or (str(local) if local.exists() else None)
    if found is None:
        sys.exit(
            "api_image: buf not found; install it as .ci/run does: npm install --no-save "
            "--prefix .venv/buf @bufbuild/buf@1.75.0"
        )
    return found


def write_image(buf: str) -> None:
    """Build the image of ``proto/`` and write it, indented, to ``api/image.json``."""
    with tempfile.TemporaryDirectory() as tmp:
        built = Path(tmp) / "image.json"
        subprocess.run(
            [buf, "build", "proto", "--exclude-source-info", "-o", str(built)],
            check=True,
            cwd=ROOT,
        )
        image = json.loads(built.read_text())
    IMAGE.parent.mkdir(exist_ok=True)
    IMAGE.write_text(json.dumps(image, indent=1) + "\n")
    print(f"wrote {IMAGE.relative_to(ROOT)}: {len(image['file'])} files")


def check(buf: str) -> int:
    """``buf breaking`` of ``proto/`` against the committed image; its exit code."""
    return subprocess.run(
        [buf, "breaking", "proto", "--against", str(IMAGE.relative_to(ROOT))], cwd=ROOT
    ).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="run buf breaking, write nothing")
    args = parser.parse_args()
    buf = find_buf()
    if args.check:
        return check(buf)
    write_image(buf)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
