"""Speculative decoding through a real `rsgl serve --speculative-algorithm NGRAM` and real
clients: SGLang's speculation fields in each request's meta_info, streamed chat text equal to
the unstreamed one, the average accept length in /metrics (read by prometheus_client's
parser) and in the server's periodic log line."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from launcher import launch, stop
from prometheus_client.parser import text_string_to_metric_families

from rsgl.bench.speculative import copy_heavy_messages
from rsgl.server.frontend import sum_stats

MODEL = "SmolLM2-135M-Instruct"
FLAGS = ("--dtype", "float32", "--max-total-tokens", "16384")
# Drafting on every step: whether the adaptive policy drafts depends on this CPU's timings.
SPEC = (
    "--speculative-algorithm",
    "NGRAM",
    "--speculative-num-draft-tokens",
    "5",
    "--disable-speculative-adaptive",
)
# A prompt the model continues by quoting it: some drafts are accepted.
COPY = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    log_path = tmp_path_factory.mktemp("spec-server") / "server.log"
    proc, url = launch(log_path, *FLAGS, *SPEC)
    yield url, log_path
    stop(proc, log_path)


def generate(url: str, text: str, **params: Any) -> dict[str, Any]:
    body = {"text": text, "sampling_params": {"temperature": 0, **params}}
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def test_meta_info_reports_each_requests_speculation(server: tuple[str, Path]) -> None:
    url, _ = server
    meta = generate(url, COPY, max_new_tokens=48, ignore_eos=True)["meta_info"]
    assert meta["completion_tokens"] == 48
    # The first token comes from the prefill; each verify step commits its accepted drafts
    # and one token of its own.
    verify_ct, accepted = meta["spec_verify_ct"], meta["spec_accept_token_num"]
    assert 0 < verify_ct < 47
    assert 0 < accepted <= meta["spec_draft_token_num"]  # the text quotes its prompt
    assert meta["spec_accept_rate"] == pytest.approx(accepted / meta["spec_draft_token_num"])
    assert meta["spec_accept_length"] == pytest.approx(1 + accepted / verify_ct)


def test_streamed_chat_equals_the_whole_answer(server: tuple[str, Path]) -> None:
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    messages: Any = copy_heavy_messages(1, seed=3)[0]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=64
    )
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=64, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.completion_tokens > 0


def test_metrics_and_log_line_report_the_accept_length(server: tuple[str, Path]) -> None:
    url, log_path = server
    generate(url, COPY, max_new_tokens=32, ignore_eos=True)
    # The scheduler sends its statistics every second, and the log line every 10 s: wait
    # for both (a wait, not a bound: the assertions below are on what they report).
    accept = 0.0
    for _ in range(60):
        families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
        samples = [s for f in families if f.name == "rsgl_spec_accept_length" for s in f.samples]
        accept = samples[0].value if samples else 0.0
        if accept > 0 and "accept len" in log_path.read_text():
            break
        time.sleep(0.5)
    assert accept > 1.0  # some drafts were accepted
    lines = [line for line in log_path.read_text().splitlines() if "accept len" in line]
    assert lines and "gen throughput" in lines[0]


def test_data_parallel_ranks_stats_combine_into_one_accept_length() -> None:
    ranks = [
        {"spec_drafted_rows": 10, "spec_committed_tokens": 30, "spec_accept_length": 3.0},
        {"spec_drafted_rows": 30, "spec_committed_tokens": 30, "spec_accept_length": 1.0},
    ]
    ranks[0]["spec_draft_limit"], ranks[1]["spec_draft_limit"] = 4, 0
    total = sum_stats(ranks)
    assert total["spec_drafted_rows"] == 40
    assert total["spec_accept_length"] == 1.5  # 60 tokens over 40 rows, not 3 + 1
    assert total["spec_draft_limit"] == 4
