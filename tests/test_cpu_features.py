"""The CPU as rsgl sees it: bfloat16 units from /proc/cpuinfo's flags, physical cores from
sysfs' topology (both read from made-up files here)."""

from __future__ import annotations

from pathlib import Path

from rsgl.cpu_features import (
    affinity_cpus,
    cpu_bf16_features,
    default_cpu_threads,
    physical_cores,
)

CPUINFO = """processor\t: {n}
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx2 avx512f {extra}
bugs\t\t: spectre_v1

"""


def write_cpuinfo(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text("".join(CPUINFO.format(n=n, extra=extra) for n in range(2)))
    return path


def test_bf16_units_are_read_from_the_flags(tmp_path: Path) -> None:
    sapphire = write_cpuinfo(tmp_path, "avx512_bf16 amx_bf16 amx_tile amx_int8")
    assert cpu_bf16_features(sapphire) == {"amx_bf16", "avx512_bf16"}
    zen4 = write_cpuinfo(tmp_path, "avx512_bf16 avx512_vnni")
    assert cpu_bf16_features(zen4) == {"avx512_bf16"}
    # A flag name that merely contains a bf16 flag's is not it.
    older = write_cpuinfo(tmp_path, "avx512_vnni amx_bf16x")
    assert cpu_bf16_features(older) == frozenset()


def test_an_unreadable_cpuinfo_means_no_bf16_units(tmp_path: Path) -> None:
    assert cpu_bf16_features(tmp_path / "missing") == frozenset()


def write_topology(sysfs: Path, cpu: int, package: int, core: int) -> None:
    topology = sysfs / f"cpu{cpu}" / "topology"
    topology.mkdir(parents=True)
    (topology / "physical_package_id").write_text(f"{package}\n")
    (topology / "core_id").write_text(f"{core}\n")


def test_hyperthreads_of_one_core_count_once(tmp_path: Path) -> None:
    # Two sockets, two cores each, two hyperthreads per core: CPUs 0-3 and 4-7 are siblings.
    for cpu in range(8):
        write_topology(tmp_path, cpu, package=cpu // 2 % 2, core=cpu % 2)
    assert physical_cores(frozenset(range(8)), tmp_path) == 4
    assert physical_cores(frozenset({0, 4}), tmp_path) == 1
    assert physical_cores(frozenset({0, 1}), tmp_path) == 2
    # Without topology files each logical CPU counts as a core.
    assert physical_cores(frozenset({8, 9, 10}), tmp_path) == 3


def test_the_default_thread_count_fits_the_affinity() -> None:
    assert 1 <= default_cpu_threads() <= len(affinity_cpus())
