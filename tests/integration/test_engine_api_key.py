"""kvgate in front of an engine run with ``--api-key`` (the mini vLLM's flag, which guards ``/v1`` as vLLM's
does): its own calls to the engine (``/v1/models``, ``/tokenize``) carry ``upstream.api_key``, or the model's
length stays unknown and the refusal is logged once."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from tests.support.procs import Proc
from tests.support.promtext import assert_ledger_empty

pytestmark = pytest.mark.e2e

KEY = "engine-secret"
CHAT = {"model": "mini", "messages": [{"role": "user", "content": "Say something"}]}  # no max_tokens


def wait_for_tokenizer(gw: str, name: str, timeout_s: float = 10.0) -> str:
    """The counter /readyz names once ``tokenizer: auto`` has resolved to ``name`` (or the last one seen)."""
    deadline = time.monotonic() + timeout_s
    while (seen := httpx.get(gw + "/readyz").json()["tokenizer"]) != name and time.monotonic() < deadline:
        time.sleep(0.05)
    return str(seen)


def test_discovery_and_tokenize_carry_the_engines_key(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    """With the key, /v1/models answers: max_model_len is known (a chat without max_tokens is served, up to the
    whole 4,096-token context) and ``tokenizer: auto`` finds the engine's /tokenize, which gets the key too."""
    upstream = mini_vllm(api_key=KEY, token_delay_ms=0)
    assert httpx.get(upstream + "/v1/models").status_code == 401  # what vLLM answers without the key
    ours = len(httpx.get(upstream + "/debug/keyed").json())  # this test's own calls, without the key
    gw = gateway(upstream, {"tokenizer": "auto", "upstream": {"api_key": KEY}})
    assert wait_for_tokenizer(gw, "vllm") == "vllm"
    r = httpx.post(gw + "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer client-key"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == 4096
    keyed = httpx.get(upstream + "/debug/keyed").json()[ours:]
    paths = {path for path, _ in keyed}
    assert {"/v1/models", "/tokenize", "/v1/chat/completions", "/metrics"} <= paths
    assert all(ok for path, ok in keyed if path != "/metrics"), keyed
    assert assert_ledger_empty(gw)["kvgate_requests_admitted_total"] == 1


def test_a_refused_discovery_is_logged_once_and_a_chat_without_max_tokens_is_400(
    mini_vllm: Callable[..., str], gateway: Callable[..., str], procs: list[Proc]
) -> None:
    """Without the key, /v1/models answers 401 on every scrape: one warning names the status and the fix, and
    kvgate cannot price a chat without max_tokens (an OpenAI-shaped 400, not a silent failure)."""
    upstream = mini_vllm(api_key=KEY, token_delay_ms=0)
    gw = gateway(upstream, {"tokenizer": "auto", "telemetry": {"scrape_interval_s": 0.05}})

    def scrapes() -> int:
        return sum(1 for path, _ in httpx.get(upstream + "/debug/keyed").json() if path == "/v1/models")

    deadline = time.monotonic() + 10
    while scrapes() < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scrapes() >= 5  # discovery retried every scrape
    assert httpx.get(gw + "/readyz").json()["tokenizer"].startswith("heuristic")  # auto never resolved
    r = httpx.post(gw + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    warnings = [line for line in procs[-1].log().splitlines() if "/v1/models answered HTTP 401" in line]
    assert len(warnings) == 1 and "upstream.api_key" in warnings[0], warnings
