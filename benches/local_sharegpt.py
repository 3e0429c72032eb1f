"""Write a ShareGPT-format JSON file from text already on this machine (the standard
library's docstrings), for `python -m sglang.bench_serving --dataset-name random
--dataset-path FILE` on a machine that cannot download ShareGPT. SGLang's random dataset only
takes its prompt text from the file (cut or repeated to `--random-input-len` tokens), so any
English prose serves.

    python benches/local_sharegpt.py /tmp/sharegpt_local.json
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
from pathlib import Path

MIN_CHARS = 400
MODULES = [
    "argparse",
    "asyncio",
    "collections",
    "concurrent.futures",
    "dataclasses",
    "decimal",
    "email.message",
    "functools",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "os",
    "pathlib",
    "pickle",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "ssl",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.request",
    "uuid",
    "zipfile",
    "xml.etree.ElementTree",
]


def docstrings() -> list[str]:
    """The long docstrings of the classes and functions of some standard-library modules."""
    texts = set()
    for name in MODULES:
        for _, obj in inspect.getmembers(importlib.import_module(name)):
            doc = inspect.getdoc(obj) if inspect.isclass(obj) or inspect.isfunction(obj) else None
            if doc and len(doc) >= MIN_CHARS:
                texts.add(doc)
    return sorted(texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--count", type=int, default=1000)
    args = parser.parse_args()
    texts = docstrings()
    if len(texts) < 2:
        raise SystemExit("found too little text")
    rows = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": texts[i % len(texts)]},
                {"from": "gpt", "value": texts[(i + 1) % len(texts)]},
            ],
        }
        for i in range(args.count)
    ]
    args.output.write_text(json.dumps(rows))
    print(f"{args.output}: {len(rows)} conversations from {len(texts)} docstrings")


if __name__ == "__main__":
    main()
