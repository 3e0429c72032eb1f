"""The CPU as rsgl sees it: bfloat16 units from /proc/cpuinfo's flags, physical cores from
sysfs' topology (both read from made-up files here)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from rsgl.cpu_features import (
    ENV,
    LEVELS,
    affinity_cpus,
    allows,
    core_cpus,
    cpu_bf16_features,
    cpu_flags,
    default_cpu_threads,
    emulated_level,
    kernel_march,
    library_env,
    missing_flags,
    omp_bind_cpus,
    parse_cpu_list,
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


def test_each_core_is_named_by_its_lowest_logical_cpu(tmp_path: Path) -> None:
    # Two cores with two hyperthreads each, numbered as Linux does: siblings 0/2 and 1/3.
    for cpu in range(4):
        write_topology(tmp_path, cpu, package=0, core=cpu % 2)
    assert core_cpus(frozenset(range(4)), tmp_path) == [0, 1]
    assert core_cpus(frozenset({2, 3}), tmp_path) == [2, 3]
    assert core_cpus(frozenset({1, 2}), tmp_path) == [1, 2]


def test_cpu_lists_read_as_linux_writes_them() -> None:
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5, 1") == [5, 1]
    for bad, says in [
        ("0-", "not a CPU"),
        ("a", "not a CPU"),
        ("3-1", "not a range"),
        ("-1", "not a CPU"),
        ("0-2,1", "twice"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_cpu_list(bad)


def test_auto_pins_one_thread_per_core_for_a_lone_model_process(tmp_path: Path) -> None:
    for cpu in range(8):  # four cores, siblings c and c + 4
        write_topology(tmp_path, cpu, package=0, core=cpu % 4)
    every = frozenset(range(8))
    assert omp_bind_cpus("auto", 4, 1, every, tmp_path) == [0, 1, 2, 3]
    assert omp_bind_cpus("auto", 2, 1, every, tmp_path) == [0, 1]
    assert omp_bind_cpus("auto", 2, 1, frozenset({5, 6, 7}), tmp_path) == [5, 6]
    # More threads than cores, or ranks sharing the node: the OS places them.
    assert omp_bind_cpus("auto", 5, 1, every, tmp_path) is None
    assert omp_bind_cpus("auto", 2, 2, every, tmp_path) is None
    assert omp_bind_cpus("nobind", 2, 1, every, tmp_path) is None


def test_an_explicit_cpu_list_is_checked_against_the_affinity() -> None:
    assert omp_bind_cpus("3,1", 8, 1, frozenset({1, 3})) == [3, 1]
    with pytest.raises(ValueError, match=r"CPUs \[2\] outside"):
        omp_bind_cpus("1-2", 2, 1, frozenset({0, 1}))
    with pytest.raises(ValueError, match="one model process per node"):
        omp_bind_cpus("0", 1, 2, frozenset({0, 1}))


def test_the_default_thread_count_fits_the_affinity() -> None:
    assert 1 <= default_cpu_threads() <= len(affinity_cpus())


SAPPHIRE = "avx avx2 fma f16c avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16 amx_bf16"


def test_a_level_keeps_only_its_simd_flags(tmp_path: Path) -> None:
    cpuinfo = write_cpuinfo(tmp_path, SAPPHIRE.replace("avx2 ", "avx2 sse4_2 "))
    everything = cpu_flags(cpuinfo, level=None)
    assert {"amx_bf16", "avx512f", "sse4_2"} <= everything
    avx2 = cpu_flags(cpuinfo, LEVELS["avx2"])
    assert {"avx2", "fma", "f16c", "sse4_2", "fpu"} <= avx2
    assert not avx2 & {"avx512f", "avx512_bf16", "amx_bf16"}
    scalar = cpu_flags(cpuinfo, LEVELS["scalar"])
    assert "sse4_2" in scalar and not scalar & {"avx", "avx2", "avx512f"}
    zen4 = cpu_flags(cpuinfo, LEVELS["avx512_bf16"])
    assert {"avx512f", "avx512_bf16"} <= zen4 and "amx_bf16" not in zen4


def test_a_level_the_cpu_lacks_names_what_is_missing(tmp_path: Path) -> None:
    zen3 = write_cpuinfo(tmp_path, "avx avx2 fma f16c")
    assert missing_flags(LEVELS["avx2"], zen3) == ()
    assert missing_flags(LEVELS["scalar"], zen3) == ()
    assert missing_flags(LEVELS["avx512"], zen3) == ("avx512bw", "avx512cd", "avx512dq", "avx512vl")


def test_the_level_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert emulated_level({}) is None and emulated_level({ENV: "native"}) is None
    with pytest.raises(ValueError, match="expected native or one of scalar, avx2"):
        emulated_level({ENV: "avx3"})
    if platform.machine() != "x86_64":
        pytest.skip("the levels are x86-64's")
    assert emulated_level({ENV: "AVX2"}) is LEVELS["avx2"]
    monkeypatch.setenv(ENV, "avx2")
    assert kernel_march() == ("-march=x86-64-v3",)
    assert not allows("avx512bw") and allows("avx2") and allows("sse4_2")
    assert not cpu_bf16_features()  # whatever this CPU has
    assert library_env(emulated_level()) == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    }
    monkeypatch.delenv(ENV)
    assert kernel_march() == ("-march=native",) and allows("avx512bw")
    assert library_env(None) == {}


def test_the_cli_lists_the_levels_this_cpu_can_emulate() -> None:
    run = [sys.executable, "-m", "rsgl", "cpu-features"]
    levels = subprocess.run([*run, "--levels"], capture_output=True, text=True, check=True)
    can = levels.stdout.split()
    expected = [n for n, lvl in LEVELS.items() if not missing_flags(lvl)]
    assert can == (expected if platform.machine() == "x86_64" else [])
    env = subprocess.run([*run, "--env", "scalar"], capture_output=True, text=True, check=True)
    assert env.stdout.split() == [
        f"{ENV}=scalar",
        "ATEN_CPU_CAPABILITY=default",
        "ONEDNN_MAX_CPU_ISA=SSE41",
    ]
