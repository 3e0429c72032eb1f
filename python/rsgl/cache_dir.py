"""Where rsgl keeps converted models and compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def rsgl_cache_dir() -> Path:
    """`$RSGL_CACHE_DIR`, else `$XDG_CACHE_HOME/rsgl`, else `~/.cache/rsgl`."""
    explicit = os.environ.get("RSGL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rsgl"
