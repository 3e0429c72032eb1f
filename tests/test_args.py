"""The args dataclasses are the one source of options: every field has a flag with help, the
flags parse back to the fields' defaults, and those defaults are the Rust core's."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from rsgl._core import Scheduler, default_config
from rsgl.args import EngineArgs, ServerArgs, add_cli_args, from_cli
from rsgl.server.launch import build_parser, engine_args

# EngineArgs fields the core also has, under the same name.
SHARED_WITH_CORE = (
    "page_size",
    "max_running_requests",
    "max_prefill_tokens",
    "chunked_prefill_size",
    "schedule_policy",
    "schedule_conservativeness",
    "disable_radix_cache",
    "enable_mixed_chunk",
    "seed",
)


def test_every_field_has_a_flag_with_help_and_parses_back_to_its_default():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(ServerArgs):
        assert f.name in actions, f"--{f.name.replace('_', '-')} is missing"
        assert f.metadata["help"], f"{f.name} has no help text"
        assert f"--{f.name.replace('_', '-')}" in actions[f.name].option_strings
    assert from_cli(ServerArgs, parser.parse_args([])) == ServerArgs()
    assert engine_args(parser.parse_args([])) == EngineArgs()
    assert "--max-stop-string-len" in parser.format_help()


def test_typed_values_choices_switches_and_aliases_parse():
    ns = build_parser().parse_args(
        [
            "--port", "8080",
            "--mem-fraction-static", "0.25",
            "--request-timeout-s", "2.5",
            "--disable-radix-cache",
            "--schedule-policy", "lpm",
            "--api-key", "k",
        ]
    )  # fmt: skip
    args = from_cli(ServerArgs, ns)
    assert (args.port, args.mem_fraction, args.request_timeout_s) == (8080, 0.25, 2.5)
    assert args.disable_radix_cache and not args.enable_mixed_chunk
    assert (args.schedule_policy, args.api_key) == ("lpm", "k")
    assert args.engine_args().mem_fraction == 0.25


@pytest.mark.parametrize(
    "argv",
    [["--schedule-policy", "best"], ["--port", "eighty"], ["--load-format", "safetensors-please"]],
)
def test_a_bad_value_is_an_argparse_error(argv: list[str], capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "invalid" in capsys.readouterr().err


def test_a_cpu_list_to_bind_must_parse_and_agree_with_the_threads():
    assert EngineArgs(cpu_omp_threads_bind="0-1", cpu_threads=2).cpu_omp_threads_bind == "0-1"
    with pytest.raises(ValueError, match="not a CPU"):
        EngineArgs(cpu_omp_threads_bind="all")
    with pytest.raises(ValueError, match="disagrees with cpu_omp_threads_bind '0-1' \\(2 CPUs\\)"):
        EngineArgs(cpu_omp_threads_bind="0-1", cpu_threads=3)
    with pytest.raises(ValueError, match="one model process per node"):
        EngineArgs(cpu_omp_threads_bind="0-1", dp_size=2)


def test_the_engine_defaults_are_the_rust_cores():
    core = default_config()
    engine = EngineArgs()
    for name in SHARED_WITH_CORE:
        assert getattr(engine, name) == core[name], name
    # A core built with no options runs with exactly those defaults; given ones override.
    assert Scheduler().config == core
    assert Scheduler(chunked_prefill_size=-1, page_size=16).config == dict(
        core, chunked_prefill_size=-1, page_size=16
    )


def test_add_cli_args_refuses_a_field_type_it_cannot_parse():
    @dataclasses.dataclass
    class Odd:
        pairs: list[int] = dataclasses.field(default_factory=list, metadata={"help": "x"})

    with pytest.raises(TypeError, match="no command-line type"):
        add_cli_args(argparse.ArgumentParser(), Odd)
