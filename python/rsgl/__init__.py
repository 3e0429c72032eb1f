"""rsgl: an SGLang-family LLM serving engine with a Rust scheduling core."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from rsgl.engine import Engine


def __getattr__(name: str) -> Any:
    # Imported lazily: `import rsgl` stays light (no torch) for tools that only need the core.
    if name == "Engine":
        from rsgl.engine import Engine

        return Engine
    raise AttributeError(f"module 'rsgl' has no attribute {name!r}")


__all__ = ["Engine"]
