"""rsgl: an SGLang-family LLM serving engine with a Rust scheduling core."""

__version__ = "0.1.0"
