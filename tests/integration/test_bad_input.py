"""Client mistakes through the real HTTP stack: a real ``kvgate serve`` answers each with an OpenAI-shaped 400
that names the parameter, before anything reaches the engine, and never a 500. A broken engine /tokenize is a
502 or a 503 (with Retry-After), within the counter's short timeout."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.bpe import build_bpe_dir

pytestmark = pytest.mark.e2e

VOCAB = 300
# Like many real templates (Llama 2, Mistral): refuses a conversation that does not start with the user.
TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory with a small byte-level BPE tokenizer and the refusing template (nothing downloaded)."""
    d = build_bpe_dir(tmp_path_factory.mktemp("bad-input-model"), [Path(__file__).read_text()] * 3, VOCAB, TEMPLATE)
    (d / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return d


def _user(content: Any) -> dict[str, Any]:
    return {"model": "mini", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}


def _prompt(prompt: Any) -> dict[str, Any]:
    return {"model": "mini", "max_tokens": 4, "prompt": prompt}


CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("text-null", "chat", _user([{"type": "text", "text": None}]), "messages[0].content[0].text"),
    ("part-number", "chat", _user([{"type": "text", "text": "hi"}, 123]), "messages[0].content[1]"),
    ("part-null", "chat", _user([None]), "messages[0].content[0]"),
    ("part-array", "chat", _user([["hi"]]), "messages[0].content[0]"),
    (
        "name-number",
        "chat",
        {**_user("hi"), "messages": [{"role": "user", "content": "hi", "name": 1}]},
        "messages[0].name",
    ),
    ("tools-not-objects", "chat", {**_user("hi"), "tools": ["f"]}, "tools[0]"),
    (
        "template-refuses",
        "chat",
        {"model": "mini", "max_tokens": 4, "messages": [{"role": "assistant", "content": "hello"}]},
        "messages",
    ),
    ("empty-prompt", "completions", _prompt(""), "prompt"),
    ("empty-in-batch", "completions", _prompt(["a", ""]), "prompt"),
    ("empty-ids-in-batch", "completions", _prompt([[1], []]), "prompt"),
    ("negative-id", "completions", _prompt([1, -1]), "prompt"),
    ("id-past-vocab", "completions", _prompt([1, VOCAB]), "prompt"),
    ("id-past-vocab-in-batch", "completions", _prompt([[1], [2, VOCAB + 7]]), "prompt"),
]


def test_bad_input_is_an_openai_shaped_400_before_the_engine(
    mini_vllm: Callable[..., str], gateway: Callable[..., str], model_dir: Path
) -> None:
    upstream = mini_vllm()
    gw = gateway(upstream, {"tokenizer": f"hf:{model_dir}"})
    with httpx.Client(base_url=gw, timeout=30) as client:
        for name, endpoint, body, param in CASES:
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            resp = client.post(path, json=body)
            assert resp.status_code == 400, f"{name}: {resp.status_code} {resp.text}"
            assert resp.headers["content-type"].startswith("application/json"), name
            error = resp.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, f"{name}: {error}"
            assert (error["type"], error["param"]) == ("invalid_request_error", param), f"{name}: {error}"
            assert isinstance(error["message"], str) and error["message"], name
        # the same tokenizer still serves good requests: the 400s were about the input, not the gateway
        ok = client.post("/v1/chat/completions", json=_user([{"type": "text", "text": "hi"}, "there"]))
        assert ok.status_code == 200, ok.text
        assert client.post("/v1/completions", json=_prompt([1, VOCAB - 1])).status_code == 200
        stats = httpx.get(upstream + "/debug/stats").json()
    assert len(stats["started"]) == 2  # only the two good requests reached the engine


@pytest.mark.parametrize(
    ("fault", "status", "type_"),
    [
        ("garbage", 502, "upstream_error"),
        ("no-count", 502, "upstream_error"),
        ("500", 502, "upstream_error"),
        ("close", 502, "upstream_error"),
        ("hang", 503, "service_unavailable"),
    ],
)
def test_a_broken_engine_tokenize_is_502_or_503_quickly(
    mini_vllm: Callable[..., str], gateway: Callable[..., str], fault: str, status: int, type_: str
) -> None:
    upstream = mini_vllm(tokenize_fault=fault)
    gw = gateway(upstream, {"tokenizer": "vllm"})
    t0 = time.monotonic()
    resp = httpx.post(gw + "/v1/completions", json=_prompt("hello there"), timeout=60)
    took = time.monotonic() - t0
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == type_
    assert took < 8  # the counter's 5 s timeout, not aiohttp's 300 s default
    if status == 503:
        assert int(resp.headers["retry-after"]) >= 1 and "retry-after-ms" in resp.headers
    assert httpx.get(upstream + "/debug/stats").json()["started"] == []  # never forwarded
