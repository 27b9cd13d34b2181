"""The ready file: where a server that was started on port 0 says which ports it got.

``serve``, ``dev`` and ``python -m devstack`` take ``--ready-file PATH``: once every
server of the process listens, they write there one JSON object of their bound
addresses (``host:port``), for example ``{"address": "127.0.0.1:41231",
"metrics_address": "127.0.0.1:41232", "devstack_address": "127.0.0.1:41233",
"data_dir": "/abs/.ballet-dev", "project": "demo", "pid": 4242}``, and remove it when they
stop. Tests and ``scripts/try`` start servers on port 0 and read the ports from it, so no
one picks a free port and closes it for a server to bind later: another process can take
such a port in between (docs/decisions/0322-ports-bound-not-picked.md).

The file appears whole or not at all: it is written beside its final name and renamed.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path


def write_ready_file(path: Path, values: Mapping[str, object]) -> None:
    """Write ``values`` (JSON-serializable) to ``path`` atomically, with the process id
    under ``pid``. Raises ``OSError`` when the folder cannot be written."""
    record = {**values, "pid": os.getpid()}
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(record) + "\n", encoding="utf-8")
    os.replace(partial, path)


def remove_ready_file(path: Path | None) -> None:
    """Remove the ready file at a stop (nothing when there is none, or it is gone)."""
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()
