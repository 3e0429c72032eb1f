"""`rsgl bench soak`: the seeded mix, and a real `rsgl serve` on loopback (the embedded SmolLM2)
that must come through a mix with dropped connections and aborts without a failed request
and, once idle, with no KV held by requests or locked in the radix tree."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from launcher import launch, stop

from rsgl.bench.soak import SoakConfig, build_mix, main, request_body

KEY = "soak-key"


def test_mix_is_seeded_and_covers_every_kind_of_request() -> None:
    config = SoakConfig("http://unused", num_requests=400, disconnect_fraction=0.2, seed=3)
    specs = build_mix(config)
    assert specs == build_mix(config)
    assert specs != build_mix(SoakConfig("http://unused", num_requests=400, seed=4))
    assert {s.api for s in specs} == {"completions", "chat", "generate"}
    assert {(s.stream, s.n) for s in specs} == {(True, 1), (True, 2), (False, 1), (False, 2)}
    assert all(4 <= s.max_tokens <= 64 for s in specs)
    assert any(s.stop for s in specs) and any(s.top_logprobs is not None for s in specs)
    actions = Counter(s.action for s in specs)
    assert 0.15 < actions["drop"] / len(specs) < 0.25
    assert 0 < actions["abort"] < actions["drop"]
    assert any(s.action == "drop" and s.stream for s in specs)


def test_aborted_requests_carry_their_rid_on_every_api() -> None:
    specs = build_mix(SoakConfig("http://unused", num_requests=100, seed=0))
    for api in ("completions", "chat", "generate"):
        spec = next(s for s in specs if s.api == api)
        path, body = request_body(spec, "model", "soak_x_1")
        assert body["rid"] == "soak_x_1"
        assert path == {"completions": "/v1/completions", "chat": "/v1/chat/completions"}.get(
            api, "/generate"
        )


def test_soak_against_a_real_server_fails_nothing_and_leaks_no_kv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_path = tmp_path / "server.log"
    proc, url = launch(log_path, "--api-key", KEY, "--max-total-tokens", "40000")
    try:
        output = tmp_path / "soak.json"
        argv = [
            "--base-url",
            url,
            "--api-key",
            KEY,
            "--num-requests",
            "200",
            "--max-concurrency",
            "64",
            "--disconnect-fraction",
            "0.2",
            "--seed",
            "0",
            "--idle-timeout-s",
            "60",
            "--output",
            str(output),
        ]
        assert main(argv) == 0
    finally:
        stop(proc, log_path)
    result = json.loads(output.read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert result["requests"] == 200
    assert result["failed"] == 0, result["errors"]
    assert result["completed"] > 0 and result["dropped"] > 0 and result["aborted"] > 0
    assert sum(result[k] for k in ("completed", "dropped", "aborted", "failed")) == 200
    assert result["idle"] and result["leak_free"], result["idle_stats"]
    assert result["idle_stats"]["rss_bytes"] > 0
