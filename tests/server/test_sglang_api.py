"""SGLang's native API as SGLang's own clients use it, against a real `rsgl serve` on loopback:
/generate batches, its streaming format (read here the way `sglang.bench_serving --backend
sglang` reads it), logprobs on every chunk of every kind of stream, and `--stream-interval`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from launcher import launch, stop
from prometheus_client.parser import text_string_to_metric_families
from sglang_fields import GENERATE_REQ_INPUT_DEFAULTS, SAMPLING_PARAMS_DEFAULTS

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("sglang_api") / "server.log"
    # float32 (auto may choose bfloat16): batched and single requests, and logprobs over a
    # cached prefix, are compared at float32's precision.
    flags = ("--max-total-tokens", "40000", "--enable-metrics-compat", "sglang")
    proc, url = launch(log_path, *flags, "--dtype", "float32")
    yield url
    stop(proc, log_path)


def generate(url: str, body: dict[str, Any], status: int = 200) -> Any:
    resp = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert resp.status_code == status, resp.text
    return resp.json()


def stream_events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed /generate, which must end with `data: [DONE]`."""
    with httpx.stream("POST", f"{url}/generate", json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, **extra}


def ids_of(triples: Any) -> Any:
    """The token ids of SGLang's `[logprob, token_id, text]` triples, nested or not."""
    return [ids_of(t) if not t or isinstance(t[0], list) else t[1] for t in triples]


def values_of(triples: Any) -> list[float]:
    """The logprobs of SGLang's triples, flattened."""
    flat: list[float] = []
    for t in triples:
        flat.extend(values_of(t) if t and isinstance(t[0], list) else [t[0]])
    return flat


PROMPTS = ["The capital of France is", "One, two, three,"]


def test_a_batch_answers_prompt_by_prompt_as_its_single_requests_do(server: str) -> None:
    singles = [generate(server, {"text": p, "sampling_params": greedy(6)}) for p in PROMPTS]
    batch = generate(server, {"text": PROMPTS, "sampling_params": greedy(6)})
    assert isinstance(batch, list)
    assert [b["text"] for b in batch] == [s["text"] for s in singles]
    assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in singles]
    # n copies of each prompt, prompt by prompt (SGLang's order).
    copies = generate(server, {"text": PROMPTS, "sampling_params": greedy(6, n=2)})
    assert [c["text"] for c in copies] == [singles[0]["text"]] * 2 + [singles[1]["text"]] * 2
    # Token-id prompts, and sampling params per prompt.
    ids = [s["meta_info"]["prompt_tokens"] for s in singles]
    prompts = [
        httpx.post(f"{server}/tokenize", json={"prompt": p}).json()["tokens"] for p in PROMPTS
    ]
    assert [len(p) for p in prompts] == ids
    per_prompt = generate(
        server, {"input_ids": prompts, "sampling_params": [greedy(6), greedy(3)], "rid": ["a", "b"]}
    )
    assert per_prompt[0]["output_ids"] == singles[0]["output_ids"]
    assert per_prompt[1]["output_ids"] == singles[1]["output_ids"][:3]
    assert [o["meta_info"]["id"] for o in per_prompt] == ["a", "b"]
    # A single prompt with a list of one sampling_params is still a one-prompt batch.
    one = generate(server, {"text": [PROMPTS[0]], "sampling_params": [greedy(6)]})
    assert [o["text"] for o in one] == [singles[0]["text"]]


def test_a_batch_streams_each_choice_with_its_index(server: str) -> None:
    whole = generate(server, {"text": PROMPTS, "sampling_params": greedy(5, n=2)})
    events = stream_events(server, {"text": PROMPTS, "sampling_params": greedy(5, n=2)})
    last: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["index"] in last:
            assert e["text"].startswith(last[e["index"]]["text"])
        last[e["index"]] = e
    assert sorted(last) == [0, 1, 2, 3]
    assert [last[i]["text"] for i in range(4)] == [w["text"] for w in whole]
    assert all(last[i]["meta_info"]["finish_reason"]["type"] == "length" for i in range(4))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": PROMPTS, "sampling_params": [greedy(2)]}, "sampling_params"),
        ({"text": PROMPTS, "rid": ["only-one"]}, "rid"),
        ({"text": PROMPTS, "rid": ["same", "same"]}, "rid"),
        ({"text": PROMPTS, "return_logprob": [True]}, "return_logprob"),
        ({"text": PROMPTS, "sampling_params": [greedy(2, n=2), greedy(2)]}, "sampling_params"),
        ({"text": []}, "text"),
        ({"input_ids": [[1, 2], []]}, "input_ids"),
        ({"input_ids": [[1, 2], [49152]]}, "input_ids"),
        ({"text": "x", "input_ids": [1]}, "text"),
        ({}, "text"),
        ({"text": PROMPTS, "logprob_start_len": [-1, 0]}, "logprob_start_len"),
    ],
)
def test_malformed_batches_are_400s_naming_the_field(
    server: str, body: dict[str, Any], param: str
) -> None:
    err = generate(server, body, 400)["error"]
    assert err["param"] == param, err
    assert generate(server, {"text": "Hi", "sampling_params": greedy(1)})["meta_info"]


def test_sglang_bench_serving_reads_the_native_stream(server: str) -> None:
    """What `sglang.bench_serving --backend sglang` (0.5.23) does with each chunk: the
    request it sends, `data: ` lines up to `[DONE]`, the cumulative `text`, and
    `meta_info.completion_tokens` and `prompt_tokens` from every chunk with text."""
    payload = {
        "text": "Write a short poem about the sea.",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": False,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }
    generated, output_len, prompt_len, counts = "", 0, 0, []
    with httpx.stream("POST", f"{server}/generate", json=payload, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():  # aiohttp's `response.content` yields lines too
            chunk = line.encode().strip()
            if not chunk:
                continue
            data_bytes = chunk[6:] if chunk.startswith(b"data: ") else chunk
            if data_bytes == b"[DONE]":
                continue
            data = json.loads(data_bytes)
            prompt_len = (data.get("meta_info") or {}).get("prompt_tokens") or prompt_len
            if data.get("text"):
                generated = data["text"]
                output_len = data["meta_info"]["completion_tokens"]
                counts.append(output_len)
    whole = generate(server, dict(payload, stream=False))
    assert generated == whole["text"] and output_len == 12
    assert prompt_len == whole["meta_info"]["prompt_tokens"]
    # One token per chunk (the stream interval is 1); a chunk whose text is still held back
    # (an incomplete character) is the only reason to skip a count.
    assert counts == sorted(set(counts)) and counts[-1] == 12


def test_logprobs_ride_on_every_native_stream_chunk(server: str) -> None:
    body = {
        "text": "The sky is",
        "sampling_params": greedy(6),
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    whole = generate(server, body)["meta_info"]
    events = stream_events(server, body)
    for e in events:
        meta = e["meta_info"]
        assert (
            len(meta["output_token_logprobs"]) == meta["completion_tokens"] == len(e["output_ids"])
        )
        assert [t[1] for t in meta["output_token_logprobs"]] == e["output_ids"]
    # The second run reads the first one's cached prefix, which moves the float32 sums a little.
    final = events[-1]["meta_info"]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert ids_of(final[key]) == ids_of(whole[key])
        assert values_of(final[key]) == pytest.approx(values_of(whole[key]), abs=1e-3)


def test_logprobs_ride_on_every_openai_stream_chunk(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    kw: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8}
    whole = client.completions.create(temperature=0, logprobs=2, **kw).choices[0].logprobs
    chunks = list(client.completions.create(temperature=0, logprobs=2, stream=True, **kw))
    pieces = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].text]
    assert whole is not None and len(pieces) > 1 and all(p is not None for p in pieces)
    streamed_lp = [x for p in pieces for x in p.token_logprobs or []]
    assert streamed_lp == pytest.approx(whole.token_logprobs, abs=1e-3)
    assert [x for p in pieces for x in p.tokens or []] == whole.tokens
    assert [x for p in pieces for x in p.text_offset or []] == whole.text_offset

    msgs: Any = [{"role": "user", "content": "Name a color."}]
    chat_kw: dict[str, Any] = {"model": MODEL, "messages": msgs, "max_tokens": 6, "temperature": 0}
    chat_whole = client.chat.completions.create(logprobs=True, top_logprobs=1, **chat_kw)
    content = chat_whole.choices[0].logprobs.content  # type: ignore[union-attr]
    stream = client.chat.completions.create(logprobs=True, top_logprobs=1, stream=True, **chat_kw)
    parts = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].delta.content]
    assert len(parts) > 1 and all(p is not None and p.content for p in parts)
    streamed = [x for p in parts for x in p.content or []]  # type: ignore[union-attr]
    assert [x.token for x in streamed] == [x.token for x in content or []]
    expected = [x.logprob for x in content or []]
    assert [x.logprob for x in streamed] == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("session_id", "s1"),
        ("cache_salt", "tenant-a"),
        ("extra_key", "k"),
        ("return_sampling_mask", True),
        ("require_reasoning", True),
        ("bootstrap_room", 7),
        ("lora_path", ["a", "b"]),
    ],
)
def test_what_rsgl_cannot_do_is_a_400_naming_the_field(server: str, field: str, value: Any) -> None:
    body = {"text": PROMPTS, "sampling_params": greedy(1), field: value}
    assert generate(server, body, 400)["error"]["param"] == field
    # The same field, null or false (what SGLang's clients send by default), is accepted.
    assert generate(server, dict(body, **{field: None}))[0]["meta_info"]


def test_every_generate_req_input_field_is_accepted_at_its_default(server: str) -> None:
    """SGLang 0.5.23's whole GenerateReqInput (tests/sglang_fields.py), each field at its
    default, answers as the bare request does."""
    params = greedy(4, ignore_eos=True)
    bare = generate(server, {"text": PROMPTS[0], "sampling_params": params})
    full = generate(
        server, dict(GENERATE_REQ_INPUT_DEFAULTS, text=PROMPTS[0], sampling_params=params)
    )
    assert full["output_ids"] == bare["output_ids"] and full["text"] == bare["text"]
    # A batch may give these fields once per prompt: a list of nulls (or falses) is unset.
    per_prompt = {name: [None, None] for name in PER_PROMPT_CAPABILITIES}
    per_prompt["return_hidden_states"] = [False, False]
    batch = dict(GENERATE_REQ_INPUT_DEFAULTS, text=PROMPTS, sampling_params=params, **per_prompt)
    assert [o["output_ids"] for o in generate(server, batch)][0] == bare["output_ids"]
    for name in PER_PROMPT_CAPABILITIES:
        one_set = dict(batch, **{name: [None, "x"]})
        assert generate(server, one_set, 400)["error"]["param"] == name


# GenerateReqInput's capability fields that SGLang takes once per prompt of a batch.
PER_PROMPT_CAPABILITIES = (
    "lora_path",
    "lora_id",
    "custom_logit_processor",
    "image_data",
    "bootstrap_host",
    "bootstrap_room",
    "extra_key",
    "cache_salt",
    "kv_hints",
)


def test_every_sglang_sampling_field_is_accepted_at_its_default(server: str) -> None:
    """SGLang 0.5.23's whole SamplingParams, each field at its default (`sampling_seed` set,
    to compare): the same tokens as rsgl's own defaults with the same `seed`."""
    prompt = "Once upon a time"
    sglang = dict(SAMPLING_PARAMS_DEFAULTS, max_new_tokens=8, ignore_eos=True, sampling_seed=11)
    ours = {"max_new_tokens": 8, "ignore_eos": True, "seed": 11}
    outs = []
    for params in (sglang, ours):
        # Each from an empty prefix cache: a cached prefix moves the logits a little, and a
        # sampled (temperature 1) token may flip with them.
        assert httpx.post(f"{server}/flush_cache", timeout=30).status_code == 200
        outs.append(generate(server, {"text": prompt, "sampling_params": params})["output_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 8


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop_regex", ["[0-9]"]),
        ("custom_params", {"bias": 1}),
        ("beam_width", 2),
    ],
)
def test_sglang_sampling_fields_rsgl_cannot_honour_are_400s_naming_them(
    server: str, field: str, value: Any
) -> None:
    err = generate(server, {"text": "Hi", "sampling_params": greedy(1, **{field: value})}, 400)
    assert err["error"]["param"] == field and "not supported" in err["error"]["message"]
    batch = {"text": PROMPTS, "sampling_params": [greedy(1), greedy(1, **{field: value})]}
    assert generate(server, batch, 400)["error"]["param"] == field
    # Unset as SGLang's clients send it: null, or the empty value SGLang reads as unset.
    unset = {"beam_width": 1, "custom_params": {}, "stop_regex": []}.get(field, "")
    for nothing in (None, unset):
        assert generate(server, {"text": "Hi", "sampling_params": greedy(1, **{field: nothing})})


def test_a_request_may_set_its_own_stream_interval(server: str) -> None:
    body = {"text": "Count:", "sampling_params": greedy(10, ignore_eos=True, stream_interval=4)}
    counts = [e["meta_info"]["completion_tokens"] for e in stream_events(server, body)]
    # Chunks of 4 tokens (8 at once for a reader that fell behind), the rest with the finish;
    # the server's own interval (1) would send up to 10 chunks.
    assert counts[-1] == 10 and set(counts[:-1]) <= {4, 8}


def test_return_prompt_token_ids_echoes_each_choices_prompt(server: str) -> None:
    body = {"text": PROMPTS, "sampling_params": greedy(1), "return_prompt_token_ids": True}
    outs = generate(server, body)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens = httpx.post(f"{server}/tokenize", json={"prompt": prompt}).json()["tokens"]
        assert out["prompt_token_ids"] == tokens
    assert "prompt_token_ids" not in generate(server, dict(body, return_prompt_token_ids=False))[0]


def test_spaces_between_special_tokens_is_accepted(server: str) -> None:
    body = {"text": "Hi", "sampling_params": greedy(3, skip_special_tokens=False)}
    plain = generate(server, body)
    for flag in (True, False):
        params = greedy(3, skip_special_tokens=False, spaces_between_special_tokens=flag)
        assert generate(server, dict(body, sampling_params=params))["text"] == plain["text"]
    bad = greedy(3, spaces_between_special_tokens="yes")
    err = generate(server, {"text": "Hi", "sampling_params": bad}, 400)["error"]
    assert err["param"] == "spaces_between_special_tokens"


def test_stream_interval_sends_n_tokens_per_chunk(tmp_path: Path) -> None:
    log_path = tmp_path / "server.log"
    proc, url = launch(log_path, "--stream-interval", "3", "--load-format", "null")
    try:
        body = {"input_ids": [1000, 2000, 3000], "sampling_params": {"max_new_tokens": 10}}
        whole = generate(url, body)
        events = stream_events(url, body)
        counts = [e["meta_info"]["completion_tokens"] for e in events]
        # Every chunk but the last holds a multiple of 3 tokens (a consumer that falls
        # behind gets two intervals at once); the last one comes when the request ends.
        assert counts[-1] == 10 and counts == sorted(set(counts))
        assert all(c % 3 == 0 for c in counts[:-1]) and len(counts) >= 2
        assert events[-1]["output_ids"] == whole["output_ids"]
        assert [e["output_ids"] for e in events] == [whole["output_ids"][:c] for c in counts]
    finally:
        stop(proc, log_path)


SGLANG_SERIES = {
    # name: the labels SGLang 0.5 gives it
    "sglang:num_running_reqs": {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"},
    "sglang:num_queue_reqs": {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"},
    "sglang:token_usage": {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"},
    "sglang:cache_hit_rate": {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"},
    "sglang:gen_throughput": {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"},
    "sglang:prompt_tokens_total": {"model_name", "engine_type", "is_streaming"},
    "sglang:generation_tokens_total": {"model_name", "engine_type", "is_streaming"},
    "sglang:time_to_first_token_seconds_count": {"model_name", "engine_type", "is_streaming"},
    "sglang:inter_token_latency_seconds_count": {"model_name", "engine_type"},
    "sglang:e2e_request_latency_seconds_count": {"model_name", "engine_type", "is_streaming"},
}


def samples(url: str) -> list[Any]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(found: list[Any], name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in found
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_metrics_carry_sglangs_names_and_labels_beside_rsgls(server: str) -> None:
    before = samples(server)
    body = {"text": "Count: one, two,", "sampling_params": greedy(5, ignore_eos=True)}
    whole = generate(server, body)
    streamed = stream_events(server, body)
    assert streamed[-1]["text"] == whole["text"]
    after = samples(server)
    for name, labels in SGLANG_SERIES.items():
        series = [s for s in after if s.name == name]
        assert series, f"{name} is missing"
        assert all(set(s.labels) == labels for s in series), (name, series[0].labels)
        assert all(s.labels["model_name"] == MODEL for s in series)
    for streaming in ("false", "true"):
        moved = total(after, "sglang:generation_tokens_total", is_streaming=streaming) - total(
            before, "sglang:generation_tokens_total", is_streaming=streaming
        )
        assert moved == 5, streaming
        name = "sglang:e2e_request_latency_seconds_count"
        assert (
            total(after, name, is_streaming=streaming) - total(before, name, is_streaming=streaming)
            == 1
        )
    # The same observations feed both families.
    assert total(after, "sglang:generation_tokens_total") == total(
        after, "rsgl_generation_tokens_total"
    )
    assert total(after, "sglang:prompt_tokens_total") == total(after, "rsgl_prompt_tokens_total")
    assert total(after, "sglang:inter_token_latency_seconds_count") == total(
        after, "rsgl_inter_token_latency_seconds_count"
    )
