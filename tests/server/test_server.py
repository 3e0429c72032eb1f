"""A real `rsgl serve` on loopback (the embedded SmolLM2), hit with the official openai client,
httpx and prometheus_client's parser."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from launcher import launch, stop
from prometheus_client.parser import text_string_to_metric_families

from rsgl.cpu_features import affinity_cpus, core_cpus

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    # float32 (auto may choose bfloat16): tests compare a request's tokens across runs and
    # expect the float32 model's answers.
    flags = ("--api-key", KEY, "--max-total-tokens", "40000", "--dtype", "float32")
    proc, url = launch(log_path, *flags)
    yield url
    stop(proc, log_path)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def stats(server: str) -> dict[str, Any]:
    info = httpx.get(f"{server}/get_server_info", headers=AUTH, timeout=10).json()
    return dict(info["stats"])


def wait_idle(server: str) -> dict[str, Any]:
    """Waits for the scheduler's periodic stats to show an idle engine."""
    deadline = time.time() + 30
    while time.time() < deadline:
        s = stats(server)
        if s and s["live"] == 0 and s["running"] == 0 and s["waiting"] == 0:
            return s
        time.sleep(0.5)
    pytest.fail(f"engine never went idle: {stats(server)}")


def test_completions_stream_and_not_agree(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16}
    whole = client.completions.create(temperature=0, **kw)
    assert whole.choices[0].text and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage is not None and whole.usage.prompt_tokens == 5
    chunks = list(
        client.completions.create(
            temperature=0, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_server_info_reports_the_dtype_choice_and_threads(server: str) -> None:
    info = httpx.get(f"{server}/get_server_info", headers=AUTH, timeout=10).json()
    assert info["dtype"] == "float32"
    assert info["dtype_choice"]["chosen"] == "float32"
    assert info["dtype_choice"]["requested"] == "float32"
    # auto speculation stays off in float32 (rsgl.speculative.choice), and says why.
    assert info["speculative_algorithm"] is None
    assert info["speculation_choice"]["reason"] == "measured to pay only with bfloat16 on AMX tiles"
    assert info["cpu_threads"] >= 1
    # One model process (no --cpu-threads, auto binding): a thread per core, each pinned to
    # its own core's first CPU, where the cores are enough (this process shares the
    # server's affinity).
    cores = core_cpus(affinity_cpus())
    expected = cores[: info["cpu_threads"]] if info["cpu_threads"] <= len(cores) else []
    assert info["compute_cpus"] == expected


def test_chat_stream_and_not_agree(client: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0)
    content = whole.choices[0].message.content
    assert content and "Paris" in content
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=20, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == content


def test_n_stop_and_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, n=2
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == out.choices[1].text
    full = out.choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]
    lp = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2
    )
    logprobs = lp.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == 5 and all(x <= 0 for x in logprobs.token_logprobs)
    assert logprobs.top_logprobs is not None
    assert all(1 <= len(t) <= 2 for t in logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2


def test_native_generate_and_control_endpoints(server: str) -> None:
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    r = httpx.post(f"{server}/generate", json=body, headers=AUTH, timeout=60).json()
    assert len(r["output_ids"]) == r["meta_info"]["completion_tokens"] > 0
    with httpx.stream(
        "POST", f"{server}/generate", json=dict(body, stream=True), headers=AUTH, timeout=60
    ) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line[6:].startswith("{")]
    # SGLang's stream: the text and ids so far, and meta_info on every chunk.
    assert events[-1]["text"] == r["text"] and events[-1]["output_ids"] == r["output_ids"]
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == len(r["output_ids"])
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["meta_info"]["finish_reason"] == r["meta_info"]["finish_reason"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(events, events[1:], strict=False))
    assert httpx.get(f"{server}/health_generate", timeout=60).status_code == 200
    wait_idle(server)
    flush = httpx.post(f"{server}/flush_cache", headers=AUTH, timeout=30)
    assert flush.status_code == 200 and flush.json()["success"]
    unknown = httpx.post(f"{server}/abort_request", json={"rid": "nope"}, headers=AUTH)
    assert unknown.json() == {"aborted": False}
    models = httpx.get(f"{server}/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == MODEL


def error_of(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return dict(err)


def test_errors_are_openai_shaped_and_the_server_stays_healthy(server: str) -> None:
    url = f"{server}/v1/completions"
    ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    err = error_of(httpx.post(url, json=dict(ok, temperature=-1), headers=AUTH), 400)
    assert err["param"] == "temperature"
    err = error_of(httpx.post(url, json=dict(ok, stream=True, top_p=0), headers=AUTH), 400)
    assert err["param"] == "top_p"  # validated before the stream starts
    error_of(httpx.post(url, json=dict(ok, prompt=""), headers=AUTH), 400)
    long = dict(ok, prompt=[100] * 9000)
    err = error_of(httpx.post(url, json=long, headers=AUTH), 400)
    assert err["message"].startswith("This model's maximum context length is 8192 tokens")
    error_of(httpx.post(url, json=ok), 401)
    error_of(httpx.post(url, json=ok, headers={"Authorization": "Bearer wrong"}), 401)
    err = error_of(httpx.post(url, json=dict(ok, model="gpt-4"), headers=AUTH), 404)
    assert err["code"] == "model_not_found"
    error_of(httpx.post(url, json={"model": MODEL}, headers=AUTH), 400)  # no prompt
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.post(url, json=ok, headers=AUTH, timeout=60).status_code == 200


def metric_values(server: str) -> dict[str, float]:
    text = httpx.get(f"{server}/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def test_concurrent_streams_with_disconnects_are_aborted_without_leaks(server: str) -> None:
    before = metric_values(server)
    aborts_before = stats(server)["aborts"]

    async def one(c: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": MODEL,
            "prompt": f"Story number {i}:",
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        chunks = 0
        async with c.stream("POST", f"{server}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if i < 16 and chunks == 3:
                        return -1  # disconnect mid-stream
        return chunks

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=600, headers=AUTH) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    results = asyncio.run(run())
    assert results[:16] == [-1] * 16
    assert all(r > 1 for r in results[16:])
    idle = wait_idle(server)
    assert idle["held"] == 0 and idle["protected"] == 0, idle
    assert idle["aborts"] - aborts_before >= 16
    after = metric_values(server)
    aborted = "rsgl_aborted_requests_total"
    assert after[aborted] - before.get(aborted, 0) >= 16
    assert after["rsgl_generation_tokens_total"] > before.get("rsgl_generation_tokens_total", 0)
    assert after["rsgl_requests_total"] - before.get("rsgl_requests_total", 0) >= 64
    assert after["rsgl_time_to_first_token_seconds_count"] > 0
    assert httpx.get(f"{server}/health").status_code == 200


def test_queue_limit_answers_503_and_a_dying_scheduler_takes_the_server_down(
    tmp_path: Path,
) -> None:
    # One request slot and a queue of one: a long request runs, the next waits, the third
    # is refused.
    log_path = tmp_path / "server.log"
    flags = ["--max-total-tokens", "8000", "--max-running-requests", "1"]
    proc, url = launch(log_path, *flags, "--max-queued-requests", "1")
    try:
        long = {"model": MODEL, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True}

        async def scenario() -> tuple[list[int], dict[str, Any]]:
            async with httpx.AsyncClient(timeout=300) as c:
                async with c.stream(
                    "POST", f"{url}/v1/completions", json=dict(long, stream=True)
                ) as running:
                    lines = running.aiter_lines()
                    while not (await anext(lines)).startswith("data: {"):
                        pass  # the first request has its first token: it holds the slot
                    waiting = asyncio.ensure_future(
                        c.post(f"{url}/v1/completions", json=dict(long, max_tokens=2))
                    )
                    await asyncio.sleep(1.0)
                    refused = await c.post(f"{url}/v1/completions", json=long)
                    codes = [refused.status_code]
                    err = refused.json()
                # Leaving the stream disconnects the first request, which frees the slot.
                codes.append((await waiting).status_code)
                return codes, err

        codes, err = asyncio.run(scenario())
        assert codes == [503, 200]
        assert err["error"]["type"] == "ServiceUnavailableError"
        assert "queued requests" in err["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 200
        pid = httpx.get(f"{url}/get_server_info").json()["scheduler_pid"]
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "the scheduler process exited unexpectedly" in log_path.read_text()


def test_cli_engine_flags_reach_the_engine_args() -> None:
    from rsgl.server.launch import build_parser, engine_args

    ns = build_parser().parse_args(["--kv-cache-dtype", "bf16", "--page-size", "16"])
    args = engine_args(ns)
    assert (args.kv_cache_dtype, args.page_size) == ("bf16", 16)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-cache-dtype", "int4"])


def test_sglang_info_load_and_tokenize_endpoints(server: str, client: openai.OpenAI) -> None:
    """The endpoints sglang-router and SGLang's tools read, with SGLang's keys."""

    def get(path: str) -> Any:
        resp = httpx.get(f"{server}{path}", headers=AUTH, timeout=10)
        assert resp.status_code == 200, (path, resp.text)
        return resp.json()

    info = get("/server_info")
    assert get("/get_server_info").keys() == info.keys()
    assert info["served_model_name"] == client.models.list().data[0].id
    assert info["max_total_num_tokens"] == info["max_total_tokens"] > 0
    assert info["chunked_prefill_size"] == 2048 and info["page_size"] == 1
    assert info["internal_states"][0]["dp_rank"] == 0
    assert info["version"] == get("/version")["version"]
    model = get("/model_info")
    assert model == get("/get_model_info")
    assert model["is_generation"] is True
    assert model["model_type"] == "llama" and model["architectures"] == ["LlamaForCausalLM"]
    # Where the model and tokenizer come from (no --model-path: the embedded SmolLM2), and
    # the sizes a router or client plans with.
    assert Path(info["model_path"], "config.json").is_file()
    assert info["tokenizer_path"] == info["model_path"] == model["model_path"]
    assert model["tokenizer_path"] == info["tokenizer_path"]
    assert info["max_running_requests"] == 256  # the default
    assert info["context_length"] == 8192  # SmolLM2's max_position_embeddings
    (listed,) = get("/v1/models")["data"]
    assert listed["id"] == info["served_model_name"]
    assert listed["root"] == info["model_path"]
    assert listed["max_model_len"] == info["context_length"]
    (load,) = get("/get_load")
    assert set(load) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    assert load["num_reqs"] >= load["num_waiting_reqs"] >= 0

    def post(path: str, body: dict[str, Any], status: int = 200) -> Any:
        resp = httpx.post(f"{server}{path}", json=body, headers=AUTH, timeout=10)
        assert resp.status_code == status, (path, resp.text)
        return resp.json()

    one = post("/tokenize", {"prompt": "Hello world"})
    assert one["count"] == len(one["tokens"]) > 0 and one["max_model_len"] == 8192
    both = post("/v1/tokenize", {"prompt": ["Hello world", "Hi"]})
    assert both["tokens"][0] == one["tokens"] and both["count"] == [len(t) for t in both["tokens"]]
    chat = post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert chat["count"] > 3
    assert post("/detokenize", {"tokens": one["tokens"]})["text"] == "Hello world"
    assert post("/v1/detokenize", {"tokens": [one["tokens"], [2]]})["text"] == ["Hello world", ""]
    assert post("/detokenize", {"tokens": [49152]}, 400)["error"]["param"] == "tokens"
    assert post("/tokenize", {"prompt": "a", "messages": []}, 400)["error"]["param"] == "prompt"


def test_a_stop_string_finish_still_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "Here is a long story about a cat who lived in a lighthouse by the sea. " * 6
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=64, temperature=0, stop=[" ", "\n", ".", ","]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens > 0


def test_generate_takes_sglangs_request_fields(server: str) -> None:
    """What sglang-router and sglang.bench_serving send: bookkeeping fields are accepted,
    unknown ones ignored, logprobs come in SGLang's layout, unsupported asks are 400s."""

    def generate(extra: dict[str, Any], status: int = 200) -> Any:
        body = {"text": "The sky is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        resp = httpx.post(f"{server}/generate", json=body | extra, headers=AUTH, timeout=60)
        assert resp.status_code == status, resp.text
        return resp.json()

    router_fields = {
        "model": MODEL,
        "return_text_in_logprobs": False,
        "log_metrics": True,
        "return_hidden_states": False,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
        "lora_path": None,
        "logprob_start_len": -1,
        "return_routed_experts": False,
        "some_future_field": {"x": 1},
    }
    plain = generate(router_fields)
    assert plain["meta_info"]["completion_tokens"] == 4
    out = generate({"return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True})
    meta = out["meta_info"]
    assert out["output_ids"] == plain["output_ids"]
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(t[0] <= 0 and isinstance(t[2], str) for t in meta["output_token_logprobs"])
    assert [len(top) for top in meta["output_top_logprobs"]] == [2, 2, 2, 2]
    assert meta["input_token_logprobs"] == []
    for field, value in [
        ("lora_path", "adapter"),
        ("image_data", "http://x/cat.png"),
        ("return_hidden_states", True),
        ("logprob_start_len", 0),
    ]:
        assert generate({field: value}, 400)["error"]["param"] == field


def test_incremental_streaming_output_streams_deltas(tmp_path: Path) -> None:
    log_path = tmp_path / "server.log"
    proc, url = launch(log_path, "--incremental-streaming-output", "--load-format", "null")
    try:
        body = {"input_ids": [1000, 2000, 3000], "sampling_params": {"max_new_tokens": 8}}
        whole = httpx.post(f"{url}/generate", json=body, timeout=60).json()
        with httpx.stream("POST", f"{url}/generate", json=dict(body, stream=True)) as resp:
            events = [json.loads(x[6:]) for x in resp.iter_lines() if x[6:].startswith("{")]
        assert "".join(e["text"] for e in events) == whole["text"]
        assert [t for e in events for t in e["output_ids"]] == whole["output_ids"]
    finally:
        stop(proc, log_path)
