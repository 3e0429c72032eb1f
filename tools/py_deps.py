"""Print the requirements of pyproject.toml (runtime, plus the extras named on the command
line) that this interpreter does not satisfy, one per line, for `pip install`.

    python tools/py_deps.py test dev | xargs -r python -m pip install

Set-up stays a no-op when everything is there: a package is only installed when it is
missing or older than its lower bound (torch, about 3 GB, is never reinstalled otherwise).
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def unmet(requirement: str) -> bool:
    """True unless the installed distribution meets `requirement` ("name>=x.y" or "name")."""
    name, _, bound = requirement.partition(">=")
    bound = bound.split(",")[0]
    name = name.split("[")[0]  # "pkg[extra]>=v" is met by pkg at v
    try:
        installed = importlib.metadata.version(name.strip())
    except importlib.metadata.PackageNotFoundError:
        return True
    return bool(bound) and _version_tuple(installed) < _version_tuple(bound)


def main(extras: list[str]) -> int:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in extras:
        wanted += project["optional-dependencies"][extra]
    for requirement in wanted:
        if unmet(requirement):
            print(requirement)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
