"""The test suite collects as one: pytest's default import mode imports every test module by
its file name (`tests` and its folders are not packages), so two test files of the same name
in different folders shadow each other and the whole-suite run stops at collection, though
each file passes alone."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_test_modules_have_unique_names() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        # conftest.py files are pytest's own, one per folder by design.
        if "__pycache__" not in path.parts and path.name != "conftest.py":
            by_name[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"rename one of each: {shared}"
