"""SGLang's own router (PyPI `sglang-router`, a test extra) with `--policy cache_aware` in front
of two `rsgl serve` workers on loopback: what the router reads from its workers (model
identity, loads), and OpenAI and native requests through it, streamed and not.

The workers run the null executor (`--load-format null`, a fixed step time): the router sees
real servers, with the embedded model's tokenizer and identity, while the test does not wait
for two CPU forwards at once."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from launcher import launch, stop
from prometheus_client.parser import text_string_to_metric_families

from rsgl.bench.serve_process import free_port

pytest.importorskip("sglang_router", reason="sglang-router is a test extra (pip install .[test])")

MODEL = "SmolLM2-135M-Instruct"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Cluster:
    router: str
    workers: list[str]
    router_log: Path


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail("the router did not come up:\n" + log.read_text())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("router")
    flags = ("--load-format", "null", "--null-step-ms", "10")
    workers = [launch(tmp / f"worker{i}.log", *flags) for i in range(2)]
    port = free_port()
    router_log = tmp / "router.log"
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "cache_aware",
        "--log-level",
        "info",
        "--worker-urls",
        *(url for _, url in workers),
    ]
    with open(router_log, "wb") as log:
        router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, router, router_log)
        yield Cluster(url, [u for _, u in workers], router_log)
    finally:
        router.terminate()
        router.wait(timeout=30)
        for i, (proc, _) in enumerate(workers):
            stop(proc, tmp / f"worker{i}.log")


def served_requests(worker: str) -> int:
    """Requests the worker has finished (its frontend counts each as it ends)."""
    text = httpx.get(f"{worker}/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return int(sum(s.value for s in samples if s.name == "rsgl_requests_total"))


def wait_for_stats(worker: str, check: Any) -> dict[str, Any]:
    """The worker's statistics (sent by its scheduler every second) once `check` holds."""
    deadline = time.monotonic() + 15
    while True:
        stats: dict[str, Any] = httpx.get(f"{worker}/server_info", timeout=10).json()["stats"]
        if check(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.3)


def test_the_router_names_the_workers_model(cluster: Cluster) -> None:
    models = httpx.get(f"{cluster.router}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    workers = httpx.get(f"{cluster.router}/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(cluster.workers)
    assert all(w["model_id"] == MODEL and w["is_healthy"] for w in workers)


def test_openai_and_native_requests_through_the_router(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.router}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id  # what a client takes from the router
    whole = client.completions.create(model=model, prompt="Hello", max_tokens=5)
    assert whole.usage is not None and whole.usage.completion_tokens == 5
    streamed = client.completions.create(model=model, prompt="Hello", max_tokens=5, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    msgs: Any = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=4)
    assert chat.choices[0].finish_reason == "length"
    chat_stream = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=4, stream=True
    )
    assert any(c.choices and c.choices[0].delta.content for c in chat_stream)

    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 6}}
    native = httpx.post(f"{cluster.router}/generate", json=body, timeout=60)
    assert native.status_code == 200, native.text
    assert native.json()["meta_info"]["completion_tokens"] == 6
    with httpx.stream(
        "POST", f"{cluster.router}/generate", json=dict(body, stream=True), timeout=60
    ) as resp:
        assert resp.status_code == 200
        events = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
    assert events[-1]["text"] == native.json()["text"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_both_workers_serve_concurrent_traffic(cluster: Cluster) -> None:
    before = [served_requests(w) for w in cluster.workers]

    async def one(client: httpx.AsyncClient, i: int) -> int:
        # Distinct prompts: no prefix is shared, so cache_aware balances by load.
        text = f"Request {i}: {'xyzw'[i % 4] * (i + 3)}"
        body = {"text": text, "sampling_params": {"max_new_tokens": 8}}
        resp = await client.post(f"{cluster.router}/generate", json=body, timeout=60)
        return resp.status_code

    async def burst() -> list[int]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert asyncio.run(burst()) == [200] * 32
    after = [served_requests(w) for w in cluster.workers]
    moved = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(moved) == 32 and all(m > 0 for m in moved), moved


def test_loads_and_flush_reach_both_workers(cluster: Cluster) -> None:
    loads = httpx.get(f"{cluster.router}/get_loads", timeout=10).json()["workers"]
    assert sorted(w["worker"] for w in loads) == sorted(cluster.workers)
    assert all(w["load"] >= 0 for w in loads)  # -1: the router could not read /get_load
    for w in cluster.workers:
        wait_for_stats(w, lambda s: s["running"] == 0 and s["waiting"] == 0)
    cached = [wait_for_stats(w, lambda s: s["evictable"] > 0)["evictable"] for w in cluster.workers]
    assert all(c > 0 for c in cached), cached
    flushed = httpx.post(f"{cluster.router}/flush_cache", timeout=30).json()
    assert flushed["workers_flushed"] == 2, flushed
    for w in cluster.workers:
        assert wait_for_stats(w, lambda s: s["evictable"] == 0)["evictable"] == 0


def test_the_router_logged_no_fallback_or_load_warning(cluster: Cluster) -> None:
    time.sleep(3)  # a few more of the router's periodic health and load checks
    text = ANSI.sub("", cluster.router_log.read_text())
    bad = [line for line in text.splitlines() if re.search(r"\b(WARN|ERROR)\b", line)]
    assert not bad, "\n".join(bad[:20])
    assert "No loads fetched" not in text
