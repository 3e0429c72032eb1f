"""`rsgl bench serving` against a fake OpenAI-compatible server on loopback: SSE parsing for
both backends, token counting, failures, the concurrency limit, datasets and the JSON output."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from word_tokenizer import WordTokenizer

from rsgl.bench import serving
from rsgl.bench.serving import (
    BenchConfig,
    BenchRequest,
    BenchRun,
    RequestResult,
    format_table,
    run_benchmark,
    summarize,
)

TOKEN_DELAY_S = 0.002


@dataclass
class FakeServerState:
    """What the fake server saw: request bodies and the peak number of requests in flight."""

    in_flight: int = 0
    max_in_flight: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)


def _fake_tokens(n: int) -> list[str]:
    return [f" t{i}" for i in range(n)]


class FakeServer:
    """An aiohttp app streaming `n` deterministic tokens " t0", " t1", ... per request.

    /v1/completions streams OpenAI chunks (usage chunk when asked); /generate streams SGLang
    native events, cumulative text when the body says `"fake_cumulative": true`, else
    incremental. A prompt containing "FAIL" gets HTTP 500; one containing "MIDFAIL" gets an
    in-stream error event after two tokens.
    """

    def __init__(self) -> None:
        self.state = FakeServerState()
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(10), "fake server did not start"

    def stop(self) -> None:
        async def cleanup() -> None:
            assert self._runner is not None
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/generate", self._generate)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self._ready.set()
        self._loop.run_forever()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def _stream(
        self, request: web.Request, prompt: str, events: Iterator[dict[str, Any]]
    ) -> web.StreamResponse:
        state = self.state
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            if "FAIL" in prompt and "MIDFAIL" not in prompt:
                return web.json_response({"error": {"message": "boom"}}, status=500)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b": keep-alive comment\n\n")
            for event in events:
                await asyncio.sleep(TOKEN_DELAY_S)
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            state.in_flight -= 1

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.state.bodies.append(body)
        prompt, n = body["prompt"], body["max_tokens"]
        usage = (body.get("stream_options") or {}).get("include_usage", False)

        def events() -> Iterator[dict[str, Any]]:
            yield {"choices": [{"index": 0, "text": "", "finish_reason": None}]}  # role-like
            for i, tok in enumerate(_fake_tokens(n)):
                if "MIDFAIL" in prompt and i == 2:
                    yield {"error": {"message": "engine died"}}
                    return
                yield {"choices": [{"index": 0, "text": tok, "finish_reason": None}]}
            if usage:
                yield {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}

        return await self._stream(request, prompt, events())

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.state.bodies.append(body)
        prompt, n = body["text"], body["sampling_params"]["max_new_tokens"]
        cumulative = bool(body.get("fake_cumulative"))
        meta_at_end = bool(body.get("fake_meta_at_end"))

        def events() -> Iterator[dict[str, Any]]:
            text = ""
            for i, tok in enumerate(_fake_tokens(n)):
                text += tok
                event: dict[str, Any] = {"text": text if cumulative else tok}
                if not meta_at_end:
                    event["meta_info"] = {"completion_tokens": i + 1, "prompt_tokens": 3}
                yield event
            final = {"completion_tokens": n, "prompt_tokens": 3}
            if cumulative:  # SGLang may repeat the whole text in a final event
                yield {"text": text, "meta_info": final}
            elif meta_at_end:
                yield {"text": "", "meta_info": final}

        return await self._stream(request, prompt, events())


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def server(fake_server: FakeServer) -> FakeServer:
    fake_server.state = FakeServerState()
    return fake_server


def _requests(n: int, output_len: int, fail: tuple[int, ...] = ()) -> list[BenchRequest]:
    return [
        BenchRequest(f"prompt {i}{' FAIL' if i in fail else ''}", 10, output_len) for i in range(n)
    ]


def test_openai_backend_counts_tokens_failures_and_honours_concurrency(server: FakeServer) -> None:
    config = BenchConfig(base_url=server.url, max_concurrency=4, warmup_requests=0)
    run = asyncio.run(run_benchmark(config, _requests(16, 8, fail=(3, 7, 11)), None))
    assert run.model == "fake-model"
    assert [r.success for r in run.results].count(False) == 3
    assert not run.results[3].success and "HTTP 500" in run.results[3].error
    for r in (r for r in run.results if r.success):
        assert r.output_tokens == 8
        assert r.generated_text == "".join(_fake_tokens(8))
        assert len(r.itl) == 7  # the empty first chunk is not an arrival
        assert 0 < r.ttft < r.e2e
    assert server.state.max_in_flight == 4
    body = server.state.bodies[0]
    assert body["stream"] is True and body["temperature"] == 0.0 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "fake-model"

    summary = summarize(run)
    assert summary["successes"] == 13 and summary["failures"] == 3
    assert summary["total_output_tokens"] == 13 * 8 and summary["total_input_tokens"] == 13 * 10
    assert summary["request_throughput"] == pytest.approx(13 / run.duration, rel=1e-2)
    assert summary["output_throughput"] == pytest.approx(13 * 8 / run.duration, rel=1e-2)
    assert "HTTP 500" in summary["first_error"]
    for metric in ("ttft", "tpot", "itl", "e2e"):
        assert 0 < summary[f"median_{metric}_ms"] <= summary[f"p99_{metric}_ms"]
    assert summary["mean_tpot_ms"] >= TOKEN_DELAY_S * 1000 * 0.5


def test_openai_backend_without_usage_tokenizes_the_text(server: FakeServer) -> None:
    config = BenchConfig(
        base_url=server.url,
        model="explicit",
        warmup_requests=1,
        ignore_eos=False,
        extra_body={"stream_options": {"include_usage": False}},
    )
    run = asyncio.run(run_benchmark(config, _requests(3, 5), lambda text: len(text.split())))
    assert all(r.success and r.output_tokens == 5 for r in run.results)
    assert len(server.state.bodies) == 4  # one warm-up request first
    assert all(b["model"] == "explicit" and b["ignore_eos"] is False for b in server.state.bodies)


def test_in_stream_error_is_a_failure(server: FakeServer) -> None:
    config = BenchConfig(base_url=server.url, warmup_requests=0)
    requests = [BenchRequest("x MIDFAIL", 1, 6), BenchRequest("y", 1, 6)]
    run = asyncio.run(run_benchmark(config, requests))
    assert not run.results[0].success and run.results[0].error == "engine died"
    assert run.results[1].success


def test_unreachable_server_is_a_failure_not_a_crash() -> None:
    config = BenchConfig(base_url="http://127.0.0.1:9", model="m", warmup_requests=0)
    run = asyncio.run(run_benchmark(config, _requests(2, 4)))
    assert [r.success for r in run.results] == [False, False]
    assert summarize(run)["failures"] == 2


@pytest.mark.parametrize(
    "stream",
    [{}, {"fake_cumulative": True}, {"fake_meta_at_end": True}],
    ids=["incremental", "cumulative", "meta-at-end"],
)
def test_native_backend_handles_incremental_and_cumulative_text(
    server: FakeServer, stream: dict[str, Any]
) -> None:
    config = BenchConfig(
        base_url=server.url, backend="rsgl", max_concurrency=2, warmup_requests=0, extra_body=stream
    )
    run = asyncio.run(run_benchmark(config, _requests(6, 7, fail=(2,))))
    assert [r.success for r in run.results] == [True, True, False, True, True, True]
    for r in (r for r in run.results if r.success):
        assert r.output_tokens == 7
        assert r.generated_text == "".join(_fake_tokens(7))
        assert len(r.itl) == 6  # a repeated final event is no arrival
    assert server.state.max_in_flight == 2
    params = server.state.bodies[0]["sampling_params"]
    assert params == {"max_new_tokens": 7, "temperature": 0.0, "ignore_eos": True}


def test_poisson_arrivals_spread_requests_over_time(server: FakeServer) -> None:
    config = BenchConfig(base_url=server.url, request_rate=100.0, warmup_requests=0, seed=1)
    run = asyncio.run(run_benchmark(config, _requests(20, 2)))
    assert all(r.success for r in run.results)
    # 19 exponential gaps of mean 10 ms: comfortably above the all-at-once time.
    assert run.duration > 0.08


def test_datasets_have_exact_lengths_and_shared_prefixes() -> None:
    tok = WordTokenizer()
    random = serving.random_requests(tok, 5, 12, 9, seed=3)
    assert [(r.prompt_len, r.output_len) for r in random] == [(12, 9)] * 5
    assert random == serving.random_requests(tok, 5, 12, 9, seed=3)
    assert all(not {0, 1, 2} & set(tok.encode(r.prompt)) for r in random)

    gsp = serving.gsp_requests(tok, 3, 4, 20, 6, 5, seed=0)
    assert len(gsp) == 12 and all(r.prompt_len == 26 and r.output_len == 5 for r in gsp)
    prefixes = [" ".join(r.prompt.split()[:20]) for r in gsp]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert prefixes[:4] != [prefixes[0]] * 4 or prefixes[4:8] != [prefixes[4]] * 4  # shuffled


def test_cli_prints_and_appends_the_json_result(
    server: FakeServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(serving, "load_tokenizer", lambda name: WordTokenizer())
    out = tmp_path / "result.jsonl"
    argv = ["--base-url", server.url + "/", "--num-prompts", "8", "--random-input-len", "16"]
    argv += ["--random-output-len", "4", "--max-concurrency", "3", "--output-file", str(out)]
    assert serving.main(argv) == 0
    gsp = ["--dataset", "gsp", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3"]
    gsp += ["--gsp-system-prompt-len", "30", "--gsp-question-len", "5", "--gsp-output-len", "3"]
    assert serving.main([*argv, *gsp, "--request-rate", "500"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    first = records[0]
    assert first["successes"] == 8 and first["failures"] == 0
    assert first["total_input_tokens"] == 8 * 16 and first["total_output_tokens"] == 8 * 4
    assert first["request_rate"] == "inf" and first["max_concurrency"] == 3
    assert first["model"] == "fake-model" and first["dataset"] == "random"
    assert records[1]["num_prompts"] == 6 and records[1]["request_rate"] == 500
    assert records[1]["total_input_tokens"] == 6 * 35
    stdout = capsys.readouterr().out
    assert "Mean TTFT (ms)" in stdout and json.dumps(first) in stdout.splitlines()
    assert server.state.max_in_flight <= 3
    assert not math.isnan(first["p99_itl_ms"])


def test_the_cache_hit_rate_is_the_servers_cached_tokens_over_the_prompts() -> None:
    results = [
        RequestResult(success=True, prompt_len=100, output_tokens=2, cached_tokens=80),
        RequestResult(success=True, prompt_len=100, output_tokens=2, cached_tokens=0),
        RequestResult(success=False, prompt_len=100, cached_tokens=100),  # failed: not counted
    ]
    summary = summarize(BenchRun(results, 1.0))
    assert summary["total_cached_tokens"] == 80 and summary["cache_hit_rate"] == 0.4
    silent = summarize(BenchRun([RequestResult(success=True, prompt_len=10)], 1.0))
    assert silent["cache_hit_rate"] is None
    assert "n/a" in format_table(silent)
