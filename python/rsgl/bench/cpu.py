"""The machine a figure was measured on, for every benchmark's report."""

from __future__ import annotations

import os
import platform

# /proc/cpuinfo flags that decide how fast bf16/int8 matrix math can be.
MATRIX_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


def cpu_description() -> str:
    """E.g. "AMD EPYC (2 cores; avx512f avx512_bf16)": model name, usable cores, flags."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0))
    present = " ".join(f for f in MATRIX_FLAGS if f in flags) or "no avx512/amx"
    return f"{model} ({cores} cores; {present})"
