"""What this process's CPU offers the model: its instruction sets, bfloat16 matrix units and
the cores it may use. Every CPU-dependent choice (the dtype, oneDNN packing, the C kernels'
build) and every test whose expectation depends on the CPU reads it here.

`RSGL_CPU_FEATURES=<level>` runs rsgl as if the CPU had at most a level's instruction sets
(`LEVELS`: scalar, avx2, avx512, avx512_bf16; unset or `native`: all it has), so a developer
on an AMX machine can run the AVX2 and scalar paths before pushing (`make test-portable`).
rsgl then reports only the level's flags, builds the C kernels for it, and names the
matching caps for torch's own kernels (`library_env`: ATen's vector width, oneDNN's ISA),
which torch reads when it starts.

Torch-free (Linux /proc and /sys, read once at start-up), so tests can hand in a made-up
/proc/cpuinfo and the server's frontend process can import it cheaply.

    rsgl cpu-features           # the CPU as rsgl sees it, and the levels it can emulate
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

# /proc/cpuinfo flags of x86 units that multiply bfloat16 at (or beyond) float32's rate:
# Intel's AMX tiles (Sapphire Rapids on) and AVX512-BF16 (Cooper Lake, AMD Zen 4 on).
BF16_FLAGS = ("amx_bf16", "avx512_bf16")

CPUINFO = Path("/proc/cpuinfo")
CPU_SYSFS = Path("/sys/devices/system/cpu")
ENV = "RSGL_CPU_FEATURES"


@dataclass(frozen=True, slots=True)
class Level:
    """An x86 feature level rsgl can run at: the flags it keeps, how the C kernels are built
    for it, and the matching caps of torch's own kernels."""

    name: str
    flags: tuple[str, ...]
    march: tuple[str, ...]
    aten: str  # ATEN_CPU_CAPABILITY: the vector width of torch's elementwise kernels
    onednn: str  # ONEDNN_MAX_CPU_ISA: the newest instructions oneDNN's GEMMs may use


_AVX2 = ("avx", "avx2", "fma", "f16c")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
LEVELS = {
    level.name: level
    for level in (
        Level("scalar", (), ("-march=x86-64", "-mtune=generic"), "default", "SSE41"),
        Level("avx2", _AVX2, ("-march=x86-64-v3",), "avx2", "AVX2"),
        Level("avx512", _AVX512, ("-march=x86-64-v4",), "avx512", "AVX512_CORE"),
        Level(
            "avx512_bf16",
            (*_AVX512, "avx512_vnni", "avx512_bf16"),
            ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
            "avx512",
            "AVX512_CORE_BF16",
        ),
    )
}
# The flags a level can take away: every SIMD extension from AVX on (SSE2 is x86-64's floor).
CAPPED_FLAGS = frozenset(
    {f for level in LEVELS.values() for f in level.flags}
    | {"avx512_fp16", "avx512ifma", "avx512vbmi", "avx512vbmi2", "avx512_bitalg"}
    | {"avx512_vpopcntdq", "avx_vnni", "avx_vnni_int8", "avx512_4fmaps", "avx512_4vnniw"}
    | {"amx_bf16", "amx_int8", "amx_tile", "amx_fp16", "vaes", "vpclmulqdq", "gfni"}
)


def emulated_level(env: dict[str, str] | os._Environ[str] = os.environ) -> Level | None:
    """The level `RSGL_CPU_FEATURES` names, or None for the CPU as it is (unset, empty or
    `native`). ValueError naming the levels for anything else, or off x86-64."""
    name = env.get(ENV, "").strip().lower()
    if name in ("", "native"):
        return None
    if name not in LEVELS:
        raise ValueError(f"{ENV}={name!r}: expected native or one of {', '.join(LEVELS)}")
    if platform.machine() not in ("x86_64", "AMD64"):
        raise ValueError(f"{ENV}={name}: levels are x86-64's, this is {platform.machine()}")
    return LEVELS[name]


def _read_flags(cpuinfo: Path) -> frozenset[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    return frozenset(flags)


def cpu_flags(cpuinfo: Path = CPUINFO, level: Level | None = None) -> frozenset[str]:
    """The CPU's /proc/cpuinfo flags as rsgl treats them: all of them, or under an emulated
    `level` (default: `RSGL_CPU_FEATURES`'s) only those of the level among `CAPPED_FLAGS`.
    Empty where /proc/cpuinfo is missing or unreadable."""
    flags = _read_flags(cpuinfo)
    level = emulated_level() if level is None and cpuinfo == CPUINFO else level
    if level is None:
        return flags
    return frozenset(f for f in flags if f not in CAPPED_FLAGS or f in level.flags)


def missing_flags(level: Level, cpuinfo: Path = CPUINFO) -> tuple[str, ...]:
    """The flags of `level` this CPU lacks (it cannot run at that level: empty when it can)."""
    have = _read_flags(cpuinfo)
    return tuple(f for f in level.flags if f not in have)


def allows(flag: str) -> bool:
    """False when the emulated level takes `flag` away; True otherwise (whether the CPU has it
    is then for the caller's own probe, such as torch's, to say)."""
    level = emulated_level()
    return level is None or flag not in CAPPED_FLAGS or flag in level.flags


def cpu_bf16_features(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The `BF16_FLAGS` the CPU reports (empty where /proc/cpuinfo is missing or unreadable:
    a CPU we cannot see is treated as one without the units; none under a level without
    them)."""
    flags = cpu_flags(cpuinfo)
    return frozenset(f for f in BF16_FLAGS if f in flags)


def kernel_march() -> tuple[str, ...]:
    """The C compiler's target flags for rsgl's CPU kernels: this CPU (`-march=native`), or
    the emulated level's."""
    level = emulated_level()
    return ("-march=native",) if level is None else level.march


def library_env(level: Level | None) -> dict[str, str]:
    """The environment that caps torch's own CPU kernels at `level` (read when torch is
    imported, and by oneDNN on first use): empty for the CPU as it is."""
    if level is None:
        return {}
    return {"ATEN_CPU_CAPABILITY": level.aten, "ONEDNN_MAX_CPU_ISA": level.onednn}


# The process's affinity before rsgl pinned a thread of its own (`before_pinning`).
_unpinned: frozenset[int] | None = None


def affinity_cpus() -> frozenset[int]:
    """The logical CPUs this process may run on (its affinity mask, which taskset, cgroups'
    cpusets and container limits narrow; all online CPUs where the OS has no such call).

    The OS reports the calling thread's mask, and rsgl pins the compute thread, where every
    model loads, to one CPU of its team (`omp_bind_cpus`): a second model loaded in the
    process read one CPU there, and set the thread's team, which both models' steps share,
    to one thread (an `rsgl.Engine` decoded 30-60% slower beside an idle second one). So
    once rsgl pins a thread, this is the mask from before (`before_pinning`)."""
    if _unpinned is not None:
        return _unpinned
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def before_pinning() -> None:
    """Records the calling thread's affinity as the process's, for `affinity_cpus` (the first
    call only): call it on a thread before narrowing its mask."""
    global _unpinned
    if _unpinned is None:
        _unpinned = affinity_cpus()


def core_cpus(cpus: frozenset[int], sysfs: Path = CPU_SYSFS) -> list[int]:
    """One logical CPU per physical core that `cpus` span (each core's lowest), ascending.
    Two hyperthreads of one core share its vector units, so GEMM threads beyond one per
    core add contention, not throughput. A logical CPU counts as its own core where sysfs
    does not say (containers without /sys)."""
    first: dict[tuple[str, str] | int, int] = {}
    for cpu in sorted(cpus):
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            first.setdefault(cpu, cpu)
            continue
        first.setdefault((package, core), cpu)
    return sorted(first.values())


def physical_cores(cpus: frozenset[int], sysfs: Path = CPU_SYSFS) -> int:
    """How many physical cores `cpus` span (`core_cpus`)."""
    return max(1, len(core_cpus(cpus, sysfs)))


def parse_cpu_list(text: str) -> list[int]:
    """CPUs written as Linux lists them ("0-3,8,10-11"), in the order written; ValueError
    naming the part that is not a CPU or a range of them, or a CPU named twice."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise ValueError(
                f"{part.strip()!r} in {text!r} is not a CPU or a range of CPUs"
            ) from None
        if first < 0 or last < first:
            raise ValueError(f"{part.strip()!r} in {text!r} is not a range of CPUs")
        cpus.extend(range(first, last + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{text!r} names a CPU twice")
    return cpus


def omp_bind_cpus(
    setting: str,
    threads: int,
    ranks_on_node: int,
    cpus: frozenset[int] | None = None,
    sysfs: Path = CPU_SYSFS,
) -> list[int] | None:
    """The CPUs a model process's compute threads are pinned to, one each (its intra-op
    thread i to the i-th; the caller, which runs the Python of every step, to the first),
    or None to leave them to the OS (`--cpu-omp-threads-bind`, named as vLLM's and SGLang's
    CPU backends name their variable).

    - "nobind": None.
    - "auto": the first `threads` physical cores of this process's affinity, one logical
      CPU each, where this process is the node's only model process (one rank) and they
      are enough; else None: ranks sharing the cores are left to the OS. On 2 cores a
      pinned pair decoded SmolLM2 at batch 1 ~4% faster in the server than a floating one:
      libgomp's workers never migrate, and the frontend and the scheduler's loop thread
      fill what the pair leaves.
    - a CPU list ("0-3"): those CPUs, with as many threads (they must be in this process's
      affinity; one rank only).
    """
    if setting == "nobind":
        return None
    allowed = affinity_cpus() if cpus is None else cpus
    if setting == "auto":
        cores = core_cpus(allowed, sysfs)
        return cores[:threads] if ranks_on_node == 1 and threads <= len(cores) else None
    chosen = parse_cpu_list(setting)
    outside = [c for c in chosen if c not in allowed]
    if outside:
        raise ValueError(
            f"cpu_omp_threads_bind names CPUs {outside} outside this process's affinity "
            f"({sorted(allowed)})"
        )
    if ranks_on_node != 1:
        raise ValueError(
            "cpu_omp_threads_bind takes a CPU list for one model process per node only; "
            "with data- or tensor-parallel ranks use auto or nobind"
        )
    return chosen


def default_cpu_threads() -> int:
    """Intra-op threads for the model's CPU math: one per physical core this process may
    use (`--cpu-threads`' default).

    The server's frontend process and the loop thread share those cores; the frontend is
    not pinned apart. Pinning it to a core of its own only pays with >= 4 cores: on 2 it
    would halve the model's threads for a process that is ~2% busy (measured at batch 16)."""
    return physical_cores(affinity_cpus())


def main(argv: list[str]) -> int:
    """`rsgl cpu-features`: the CPU as rsgl sees it. `--levels`: the levels this CPU
    can emulate, one per line; `--env LEVEL`: the environment of `make test-portable` for it."""
    if argv[:1] == ["--levels"]:
        on_x86 = platform.machine() in ("x86_64", "AMD64")
        print("\n".join(n for n, lvl in LEVELS.items() if on_x86 and not missing_flags(lvl)))
        return 0
    if argv[:1] == ["--env"] and len(argv) == 2:
        env = {ENV: argv[1], **library_env(emulated_level({ENV: argv[1]}))}
        print(" ".join(f"{k}={v}" for k, v in env.items()))
        return 0
    level = emulated_level()
    simd = sorted(cpu_flags() & CAPPED_FLAGS)
    print(f"level: {'native' if level is None else level.name}")
    print(f"simd flags: {' '.join(simd) or 'none beyond SSE'}")
    print(f"bf16 units: {' '.join(sorted(cpu_bf16_features())) or 'none'}")
    print(f"kernels built with: {' '.join(kernel_march())}")
    for name, lvl in LEVELS.items():
        missing = missing_flags(lvl)
        print(f"  {name}: " + ("can emulate" if not missing else f"lacks {' '.join(missing)}"))
    return 0


__all__ = [
    "BF16_FLAGS",
    "CAPPED_FLAGS",
    "ENV",
    "LEVELS",
    "Level",
    "affinity_cpus",
    "allows",
    "before_pinning",
    "cpu_bf16_features",
    "core_cpus",
    "cpu_flags",
    "default_cpu_threads",
    "emulated_level",
    "kernel_march",
    "library_env",
    "missing_flags",
    "omp_bind_cpus",
    "parse_cpu_list",
    "physical_cores",
]
