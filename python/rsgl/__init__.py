"""rsgl: an SGLang-family LLM serving engine with a Rust scheduling core."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The OpenMP runtime torch ships (libgomp) lets an idle worker spin for 300,000 rounds (a few
# milliseconds) before it sleeps. With the overlap loop, the scheduler thread then competes
# with spinning workers for the cores, and decode steps measured 5-10% slower than with
# overlap off (64 prompts, 2 cores). 20,000 rounds still bridge the gaps between one step's
# kernels: no loss at batch 1, and overlap on matches overlap off. libgomp reads this once,
# when torch is first imported, so it applies when rsgl is imported before torch (the CLI,
# the server's processes) and to child processes; an explicit setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")


def _cap_torch_kernels() -> None:
    # RSGL_CPU_FEATURES (rsgl.cpu_features) caps torch's own kernels too, where rsgl is
    # imported before torch: ATen reads its vector width at import, oneDNN its ISA on first
    # use. A bad level is reported where the features are read, not at import.
    from rsgl.cpu_features import emulated_level, library_env

    try:
        level = emulated_level()
    except ValueError:
        return
    for key, value in library_env(level).items():
        os.environ.setdefault(key, value)


_cap_torch_kernels()

if TYPE_CHECKING:
    from rsgl.engine import Engine


def __getattr__(name: str) -> Any:
    # Imported lazily: `import rsgl` stays light (no torch) for tools that only need the core.
    if name == "Engine":
        from rsgl.engine import Engine

        return Engine
    raise AttributeError(f"module 'rsgl' has no attribute {name!r}")


__all__ = ["Engine"]
