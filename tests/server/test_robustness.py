"""One bad request must never take the server down: each malformed input gets its 4xx (an
OpenAI error object), a failing step aborts only its own requests, a client that stops
reading is cut off, and SIGTERM drains. A real `rsgl serve` on loopback; after every
scenario the engine goes idle with no KV held (the core's integrity check runs whenever the
loop goes idle, and a failure there would stop the server)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from launcher import launch, stop
from prometheus_client.parser import text_string_to_metric_families

from rsgl.scheduler.loop import MAX_CONSECUTIVE_STEP_FAILURES

MODEL = "SmolLM2-135M-Instruct"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
VOCAB = 49152


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("robust") / "server.log"
    flags = [
        "--max-total-tokens",
        "40000",
        "--max-n",
        "4",
        "--max-request-bytes",
        "200000",
        "--stream-stall-timeout-s",
        "2",
        "--socket-send-buffer-bytes",
        "16384",
    ]
    # Any request whose id contains "poison" makes the first step it is in raise.
    proc, url = launch(log_path, *flags, env={"RSGL_FAULT_INJECTION": "rid=poison"})
    yield url
    stop(proc, log_path)


def stats(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/get_server_info", timeout=10).json()["stats"])


def wait_idle(url: str) -> dict[str, Any]:
    """The scheduler's stats once idle; nothing may be held or protected then."""
    deadline = time.time() + 60
    while time.time() < deadline:
        s = stats(url)
        if s and s["live"] == 0 and s["running"] == 0 and s["waiting"] == 0:
            assert s["held"] == 0 and s["protected"] == 0, s
            return s
        time.sleep(0.3)
    pytest.fail(f"engine never went idle: {stats(url)}")


def assert_serving(url: str) -> None:
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3}
    r = httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


def openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return dict(err)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


OK_COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
OK_GENERATE = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}

# (path, body, expected param or None); each used to break the server or slip through.
BAD_BODIES: list[tuple[str, dict[str, Any], str | None]] = [
    (COMPLETIONS, dict(OK_COMPLETION, prompt=[1, VOCAB]), "prompt"),
    (COMPLETIONS, dict(OK_COMPLETION, prompt=[5, -1]), "prompt"),
    (COMPLETIONS, dict(OK_COMPLETION, prompt=[[1, 2], [10**12]]), "prompt"),
    ("/generate", {"input_ids": [VOCAB + 5], "sampling_params": {}}, "input_ids"),
    ("/generate", {"input_ids": [-7]}, "input_ids"),
    (COMPLETIONS, dict(OK_COMPLETION, max_tokens=100_000_000), "max_tokens"),
    (COMPLETIONS, dict(OK_COMPLETION, max_tokens=-1), "max_tokens"),
    (CHAT, dict(OK_CHAT, max_tokens=9000), "max_tokens"),
    (CHAT, dict(OK_CHAT, max_completion_tokens=9000), "max_completion_tokens"),
    ("/generate", dict(OK_GENERATE, sampling_params={"max_new_tokens": 9000}), "max_new_tokens"),
    (COMPLETIONS, dict(OK_COMPLETION, seed=1 << 70), "seed"),
    (COMPLETIONS, dict(OK_COMPLETION, priority=1 << 70), "priority"),
    (COMPLETIONS, dict(OK_COMPLETION, top_k=1 << 70), "top_k"),
    (COMPLETIONS, dict(OK_COMPLETION, stop_token_ids=[1 << 40]), "stop_token_ids"),
    (COMPLETIONS, dict(OK_COMPLETION, stop_token_ids=[VOCAB]), "stop_token_ids"),
    (COMPLETIONS, dict(OK_COMPLETION, logit_bias={str(VOCAB): 5}), "logit_bias"),
    (COMPLETIONS, dict(OK_COMPLETION, logit_bias={"1": 500}), "logit_bias"),
    (COMPLETIONS, dict(OK_COMPLETION, logprobs=21), "logprobs"),
    (CHAT, dict(OK_CHAT, logprobs=True, top_logprobs=21), "top_logprobs"),
    (COMPLETIONS, dict(OK_COMPLETION, n=5), "n"),
    (COMPLETIONS, dict(OK_COMPLETION, stop=["x"] * 65), "stop"),
    (COMPLETIONS, dict(OK_COMPLETION, stop="y" * 2000), "stop"),
    (CHAT, dict(OK_CHAT, messages=[{"role": "robot", "content": "x"}]), "messages.0"),
    (CHAT, dict(OK_CHAT, messages=[{"role": "user", "content": 7}]), "messages.0.content"),
    (CHAT, dict(OK_CHAT, messages=[{"role": "user"}]), "messages.0.content"),
    (CHAT, dict(OK_CHAT, messages=["hello"]), "messages.0"),
    (
        "/generate",
        dict(OK_GENERATE, sampling_params={"token_ids_logprob": [VOCAB]}),
        "token_ids_logprob",
    ),
    ("/generate", dict(OK_GENERATE, sampling_params={"temperature": "hot"}), "temperature"),
    ("/generate", dict(OK_GENERATE, sampling_params={"stop_token_ids": [-1]}), "stop_token_ids"),
    ("/generate", dict(OK_GENERATE, sampling_params={"n": 0}), "n"),
    # Found by schemathesis and by hand: each used to answer 500.
    (CHAT, dict(OK_CHAT, messages=[{"role": {}, "content": "x"}]), "messages.0"),
    (CHAT, dict(OK_CHAT, messages=[{"role": [], "content": "x"}]), "messages.0"),
    (COMPLETIONS, dict(OK_COMPLETION, repetition_penalty=3.403e38), "repetition_penalty"),
    (COMPLETIONS, dict(OK_COMPLETION, temperature=3.403e38), "temperature"),
    ("/generate", dict(OK_GENERATE, sampling_params={"temperature": 1e39}), "temperature"),
    (COMPLETIONS, dict(OK_COMPLETION, logit_bias={"\u00b2": 1}), "logit_bias"),
    (COMPLETIONS, dict(OK_COMPLETION, logit_bias={"--5": 1}), "logit_bias"),
    (COMPLETIONS, dict(OK_COMPLETION, prompt="\ud800"), "prompt"),
    ("/generate", dict(OK_GENERATE, text="a\udc00"), "text"),
    (COMPLETIONS, dict(OK_COMPLETION, stop=["\udc00"]), "stop"),
    (CHAT, dict(OK_CHAT, messages=[{"role": "user", "content": "\ud800"}]), "messages.0.content"),
    # Found in review: each used to answer 500 or to widen the sampler's tables at will.
    ("/generate", dict(OK_GENERATE, sampling_params={"temperature": 10**400}), "temperature"),
    (COMPLETIONS, dict(OK_COMPLETION, stop_token_ids=list(range(65))), "stop_token_ids"),
    (
        "/generate",
        dict(OK_GENERATE, sampling_params={"token_ids_logprob": list(range(21))}),
        "token_ids_logprob",
    ),
    (COMPLETIONS, dict(OK_COMPLETION, logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES)
def test_bad_input_gets_a_400_naming_the_parameter(
    server: str, path: str, body: dict[str, Any], param: str | None
) -> None:
    # json.dumps escapes lone surrogates (\\ud800), as JavaScript's JSON.stringify does.
    raw = json.dumps(body)
    headers = {"content-type": "application/json"}
    err = openai_error(httpx.post(f"{server}{path}", content=raw, headers=headers, timeout=60), 400)
    assert err["param"] == param, err


def test_non_finite_numbers_are_refused(server: str) -> None:
    # Python's json writes NaN/Infinity literals, and the server's JSON parser reads them.
    for field, value in [
        ("temperature", "NaN"),
        ("top_p", "NaN"),
        ("presence_penalty", "Infinity"),
    ]:
        raw = json.dumps(OK_COMPLETION)[:-1] + f', "{field}": {value}}}'
        r = httpx.post(
            f"{server}{COMPLETIONS}",
            content=raw,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert openai_error(r, 400)["param"] == field


def refused_before_the_body(server: str, path: str, declared: int) -> bytes:
    """Sends `path` a request declaring a body of `declared` bytes, and only its first 100;
    returns the response's status line and headers."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n"
        )
        sock.sendall(head.encode() + b"x" * 100)
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)  # socket.timeout here: the server waited for the body
            if not chunk:
                break
            received += chunk
    return received.partition(b"\r\n\r\n")[0]


def test_malformed_bodies_and_unknown_routes_get_openai_errors(server: str) -> None:
    url = f"{server}{COMPLETIONS}"
    json_type = {"content-type": "application/json"}
    err = openai_error(httpx.post(url, content=b'{"model": "x", "prompt":', headers=json_type), 400)
    assert err["param"] is None and "not valid JSON" in err["message"]
    bad_utf8 = b'{"model": "' + bytes([0xFF, 0xFE]) + b'", "prompt": "hi"}'
    openai_error(httpx.post(url, content=bad_utf8, headers=json_type), 400)
    openai_error(httpx.post(url, content=b"[1, 2]", headers=json_type), 400)
    openai_error(httpx.get(f"{server}/no/such/path"), 404)
    unknown_model = json.dumps(dict(OK_COMPLETION, model="\ud800"))
    openai_error(httpx.post(url, content=unknown_model, headers=json_type), 404)
    openai_error(httpx.get(url), 405)
    big = {"model": MODEL, "prompt": "x" * 300_000}
    err = openai_error(httpx.post(url, json=big, timeout=30), 413)
    assert "--max-request-bytes" in err["message"]
    # A declared length over the limit is refused from the headers alone: the answer comes
    # while most of the body has not been sent (a server that read on would wait forever).
    head = refused_before_the_body(server, COMPLETIONS, declared=300_000)
    assert head.startswith(b"HTTP/1.1 413"), head

    def chunked() -> Iterator[bytes]:
        # No Content-Length: the limit must hold while the body streams in.
        yield b'{"model": "m", "prompt": "'
        for _ in range(100):
            yield b"y" * 10_000
        yield b'"}'

    openai_error(httpx.post(url, content=chunked(), headers=json_type, timeout=30), 413)
    assert_serving(server)
    wait_idle(server)


def test_good_requests_complete_while_bad_ones_arrive_with_them(server: str) -> None:
    async def good(c: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
        body = dict(
            OK_COMPLETION, prompt=f"Fact {i}:", max_tokens=8, ignore_eos=True, stream=i % 2 == 0
        )
        if i % 2:
            r = await c.post(COMPLETIONS, json=body)
            return r.status_code, r.json()["choices"][0]["finish_reason"]
        reasons = []
        async with c.stream("POST", COMPLETIONS, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    reasons.append(json.loads(line[6:])["choices"][0]["finish_reason"])
        return r.status_code, reasons[-1]

    async def bad(c: httpx.AsyncClient, i: int) -> int:
        path, body, _ = BAD_BODIES[i % len(BAD_BODIES)]
        headers = {"content-type": "application/json"}
        return (await c.post(path, content=json.dumps(body), headers=headers)).status_code

    async def run() -> tuple[list[tuple[int, str | None]], list[int]]:
        async with httpx.AsyncClient(base_url=server, timeout=300) as c:
            goods = [good(c, i) for i in range(24)]
            bads = [bad(c, i) for i in range(16)]
            results = await asyncio.gather(*goods, *bads)
        return list(results[:24]), list(results[24:])  # type: ignore[arg-type]

    goods, bads = asyncio.run(run())
    assert goods == [(200, "length")] * 24
    assert bads == [400] * 16
    wait_idle(server)


def test_a_failing_step_aborts_only_its_requests(server: str) -> None:
    failures_before = metric(server, "rsgl_step_failures_total")

    async def run() -> tuple[list[str], httpx.Response, str]:
        async with httpx.AsyncClient(base_url=server, timeout=300) as c:
            decoding = [asyncio.Event() for _ in range(6)]

            async def good(i: int) -> str:
                body = dict(
                    OK_COMPLETION,
                    prompt=f"Story {i}:",
                    max_tokens=24,
                    ignore_eos=True,
                    stream=True,
                )
                reason = ""
                try:
                    async with c.stream("POST", COMPLETIONS, json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                decoding[i].set()
                                chunk = json.loads(line[6:])
                                reason = chunk["choices"][0]["finish_reason"] or ""
                finally:
                    decoding[i].set()  # a good one that fails must not keep the poison waiting
                return reason

            goods = [asyncio.ensure_future(good(i)) for i in range(6)]
            # Every good one is decoding, so none can share the poison's prefill step (one
            # still waiting would be admitted beside the poison and fail with it).
            await asyncio.gather(*(e.wait() for e in decoding))
            poison = await c.post(
                COMPLETIONS, json=dict(OK_COMPLETION, max_tokens=8, rid="poison-1")
            )
            streamed = ""
            async with c.stream(
                "POST",
                COMPLETIONS,
                json=dict(OK_COMPLETION, max_tokens=8, rid="poison-2", stream=True),
            ) as r:
                async for line in r.aiter_lines():
                    streamed += line + "\n"
            return list(await asyncio.gather(*goods)), poison, streamed

    goods, poison, streamed = asyncio.run(run())
    assert goods == ["length"] * 6
    err = openai_error(poison, 500)
    assert "injected fault for request poison-1" in err["message"]
    events = [line[6:] for line in streamed.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "injected fault for request poison-2" in json.loads(events[-2])["error"]["message"]
    # The scheduler's stats arrive once a second: an idle snapshot may predate the failures.
    deadline = time.time() + 10
    while (idle := wait_idle(server))["step_failures"] < 2 and time.time() < deadline:
        time.sleep(0.3)
    assert idle["step_failures"] >= 2
    assert metric(server, "rsgl_step_failures_total") - failures_before >= 2
    assert_serving(server)


def test_a_client_that_stops_reading_is_aborted_and_its_kv_released(server: str) -> None:
    before = stats(server)
    aborts_before = before["aborts"]
    host, port = server.removeprefix("http://").split(":")
    body = json.dumps(
        dict(
            OK_COMPLETION,
            prompt="List every number:",
            max_tokens=2000,
            ignore_eos=True,
            n=4,
            logprobs=5,
            stream=True,
        )
    ).encode()
    request = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.socket() as sock:
        # A tiny receive window, never read: with the server's small send buffer
        # (--socket-send-buffer-bytes) its writes back up within a few hundred tokens.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(request)
        deadline = time.time() + 240
        while time.time() < deadline:
            s = stats(server)
            if s["aborts"] - aborts_before >= 4 and s["live"] == 0:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the stalled stream was never aborted: {stats(server)}")
        # Cut off well before its 4 x 2000 tokens.
        generated = stats(server)["generated_tokens"] - before["generated_tokens"]
        assert 0 < generated < 4000, generated
        idle = wait_idle(server)  # while the client is still connected
        assert idle["held"] == 0
    assert_serving(server)


def test_sigterm_drains_in_flight_requests_then_exits_0(tmp_path: Path) -> None:
    log_path = tmp_path / "server.log"
    # The limit leaves the drained stream below (32 tokens) room on a slow, busy CPU, and
    # is far below what 4,000 tokens take on any CPU.
    proc, url = launch(log_path, "--max-total-tokens", "20000", "--request-timeout-s", "10")
    try:
        # A request longer than --request-timeout-s is cut off with a 504.
        slow = dict(OK_COMPLETION, prompt="Count:", max_tokens=4000, ignore_eos=True)
        err = openai_error(httpx.post(f"{url}{COMPLETIONS}", json=slow, timeout=60), 504)
        assert "limit of 10.0 s" in err["message"]
        wait_idle(url)

        async def scenario() -> tuple[list[str], int, int]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                body = dict(
                    OK_COMPLETION, prompt="Once", max_tokens=32, ignore_eos=True, stream=True
                )
                lines: list[str] = []
                async with c.stream("POST", COMPLETIONS, json=body) as r:
                    it = r.aiter_lines()
                    while not (line := await anext(it)).startswith("data: {"):
                        pass
                    lines.append(line)
                    proc.send_signal(signal.SIGTERM)
                    # As soon as the server is draining (the stream is still running: it
                    # must be, or the server would already be gone).
                    for _ in range(100):
                        health = await c.get("/health")
                        if health.status_code != 200:
                            break
                        await asyncio.sleep(0.02)
                    refused = await c.post(COMPLETIONS, json=OK_COMPLETION)
                    health = await c.get("/health")
                    async for line in it:
                        lines.append(line)
                return lines, refused.status_code, health.status_code

        lines, refused, health = asyncio.run(scenario())
        assert (refused, health) == (503, 503)
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert "data: [DONE]" in lines
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "draining" in log_path.read_text()


def test_a_drain_past_its_timeout_aborts_the_stream_and_exits_0(tmp_path: Path) -> None:
    log_path = tmp_path / "server.log"
    # The null model at 20 ms a step: the request below would stream for minutes.
    flags = ("--load-format", "null", "--null-step-ms", "20", "--graceful-shutdown-timeout", "1")
    proc, url = launch(log_path, *flags)
    try:
        body = {
            "input_ids": [1000, 2000, 3000],
            "sampling_params": {"max_new_tokens": 6000, "ignore_eos": True},
            "stream": True,
        }

        async def scenario() -> list[str]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                lines: list[str] = []
                async with c.stream("POST", "/generate", json=body) as r:
                    it = r.aiter_lines()
                    while not (line := await anext(it)).startswith("data: {"):
                        pass
                    lines.append(line)
                    proc.send_signal(signal.SIGTERM)
                    async for line in it:
                        if line:
                            lines.append(line)
                return lines

        lines = asyncio.run(scenario())
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(x[6:]) for x in lines[:-1]]
        err = events[-1]["error"]
        assert err["code"] == 503 and "shutting down" in err["message"], err
        generated = events[-2]["meta_info"]["completion_tokens"]
        assert 0 < generated < 6000 and events[-2]["meta_info"]["finish_reason"] is None
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text()
    assert "draining 1 requests (at most 1 s)" in log
    assert "aborting 1 requests still running" in log


def test_a_run_of_failed_steps_stops_the_server_non_zero_and_says_why(tmp_path: Path) -> None:
    log_path = tmp_path / "server.log"
    # Every step fails: requests get a 500 each, until MAX_CONSECUTIVE_STEP_FAILURES in a row
    # tell the loop that the model state is broken.
    env = {"RSGL_FAULT_INJECTION": "probability=1"}
    proc, url = launch(log_path, "--load-format", "null", env=env)
    statuses: list[int] = []
    try:
        body = {"input_ids": [1000, 2000], "sampling_params": {"max_new_tokens": 4}}
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                statuses.append(httpx.post(f"{url}/generate", json=body, timeout=30).status_code)
            except httpx.HTTPError:
                time.sleep(0.2)  # the server is going down
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text()
    assert code != 0, log
    assert statuses and statuses[0] == 500, statuses
    assert len(statuses) <= MAX_CONSECUTIVE_STEP_FAILURES + 1, statuses
    assert f"StepFailed: {MAX_CONSECUTIVE_STEP_FAILURES} steps failed in a row" in log
    assert "the scheduler process exited unexpectedly (exit code 1)" in log


def test_abort_request_aborts_exactly_the_named_request(server: str) -> None:
    async def stream(
        c: httpx.AsyncClient, body: dict[str, Any], started: asyncio.Event
    ) -> list[Any]:
        reasons: list[Any] = []
        async with c.stream("POST", COMPLETIONS, json=dict(body, stream=True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    started.set()
                    choice = json.loads(line[6:])["choices"][0]
                    if choice["finish_reason"]:
                        reasons.append(choice["finish_reason"])
        return reasons

    async def run() -> tuple[list[Any], list[Any], dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server, timeout=300) as c:
            both = asyncio.Event(), asyncio.Event()
            long = dict(OK_COMPLETION, max_tokens=400, ignore_eos=True)
            # A dashed id with two choices, and a request whose id is a prefix of it.
            a = asyncio.ensure_future(stream(c, dict(long, rid="job-a", n=2), both[0]))
            b = asyncio.ensure_future(stream(c, dict(long, rid="job", max_tokens=40), both[1]))
            await both[0].wait()
            await both[1].wait()
            busy = await c.post("/flush_cache")
            assert openai_error(busy, 400)["message"].startswith("cannot flush the cache")
            aborted = (await c.post("/abort_request", json={"rid": "job-a"})).json()
            return await a, await b, aborted

    a, b, aborted = asyncio.run(run())
    assert aborted == {"aborted": True}
    assert a == ["abort", "abort"]
    assert b == ["length"]
    wait_idle(server)
