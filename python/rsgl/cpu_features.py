"""What this process's CPU offers the model: bfloat16 matrix units and the cores it may use.

Torch-free (Linux /proc and /sys, read once at start-up), so tests can hand in a made-up
/proc/cpuinfo and the server's frontend process can import it cheaply.
"""

from __future__ import annotations

import os
from pathlib import Path

# /proc/cpuinfo flags of x86 units that multiply bfloat16 at (or beyond) float32's rate:
# Intel's AMX tiles (Sapphire Rapids on) and AVX512-BF16 (Cooper Lake, AMD Zen 4 on).
BF16_FLAGS = ("amx_bf16", "avx512_bf16")

CPUINFO = Path("/proc/cpuinfo")
CPU_SYSFS = Path("/sys/devices/system/cpu")


def cpu_bf16_features(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The `BF16_FLAGS` the CPU reports (empty where /proc/cpuinfo is missing or unreadable:
    a CPU we cannot see is treated as one without the units)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags.update(value.split())
    return frozenset(f for f in BF16_FLAGS if f in flags)


def affinity_cpus() -> frozenset[int]:
    """The logical CPUs this process may run on (its affinity mask, which taskset, cgroups'
    cpusets and container limits narrow; all online CPUs where the OS has no such call)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def physical_cores(cpus: frozenset[int], sysfs: Path = CPU_SYSFS) -> int:
    """How many physical cores `cpus` span. Two hyperthreads of one core share its vector
    units, so GEMM threads beyond one per core add contention, not throughput. Counts a
    logical CPU as its own core where sysfs does not say (containers without /sys)."""
    cores: set[tuple[str, str] | int] = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            cores.add(cpu)
            continue
        cores.add((package, core))
    return max(1, len(cores))


def default_cpu_threads() -> int:
    """Intra-op threads for the model's CPU math: one per physical core this process may
    use (`--cpu-threads`' default).

    The server's frontend process and the loop thread share those cores; the frontend is
    not pinned apart. Pinning it to a core of its own only pays with >= 4 cores: on 2 it
    would halve the model's threads for a process that is ~2% busy (measured at batch 16)."""
    return physical_cores(affinity_cpus())


__all__ = [
    "BF16_FLAGS",
    "affinity_cpus",
    "cpu_bf16_features",
    "default_cpu_threads",
    "physical_cores",
]
