"""Importing rsgl before torch shortens libgomp's idle spin, unless the user set it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import os, rsgl, torch; print(os.environ.get('GOMP_SPINCOUNT'))"


@pytest.mark.parametrize(("given", "expected"), [(None, "20000"), ("123", "123")])
def test_gomp_spincount_default(given: str | None, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if given is not None:
        env["GOMP_SPINCOUNT"] = given
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == expected
