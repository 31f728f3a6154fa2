"""A client that reads its answer in one piece under a read timeout (the OpenAI SDK) must get all of it within
that timeout, not only be admitted within it: kvgate keeps the time the answer will take out of the wait it
allows, and refuses at once, with a Retry-After, what would be admitted too late to be answered."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from tests.support.promtext import assert_ledger_empty, scrape

TOKEN_DELAY_MS = 10  # the engine's pace: each request decodes one token per 10 ms, whatever else runs
CONFIG = {
    "tokenizer": "heuristic",
    "admission": {"output_estimate": {"min_samples": 8}, "queue_max_wait_s": 60},
    "telemetry": {"scrape_interval_s": 0.05},
}


def completion(gw: str, max_tokens: int, headers: dict[str, str], prompt: str = "hi", stream: bool = False):  # type: ignore[no-untyped-def]
    """A completion that runs to ``max_tokens`` (ignore_eos: its length is known, as is its answer's time)."""
    body = {"model": "mini", "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
    return httpx.post(gw + "/v1/completions", json=body, headers=headers, timeout=120)


def test_a_whole_answer_that_could_not_arrive_within_the_read_timeout_is_refused_at_once(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    upstream = mini_vllm(num_blocks=64, block_size=16, token_delay_ms=TOKEN_DELAY_MS)
    gw = gateway(upstream, CONFIG)
    for _ in range(8):  # the pace of whole answers: 20 tokens in at least 0.2 s each
        assert completion(gw, 20, {}).status_code == 200
    # a stream that holds most of the pool for ~1.5 s (150 tokens): what comes next waits for it
    blocker = threading.Thread(target=completion, args=(gw, 150, {}, "x" * 2800, True))
    blocker.start()
    replies: dict[str, httpx.Response] = {}
    try:
        deadline = time.monotonic() + 60
        while scrape(gw).get("kvgate_reserved_blocks", 0.0) < 40:
            assert time.monotonic() < deadline, "the blocker was never admitted"
        # 200 tokens take at least 2 s once admitted; the SDK's read timeout of 2.5 s leaves it 1.5 s, less 2 s
        # to wait: admitted when the blocker ends, it would time out mid-answer
        sdk = {"x-stainless-read-timeout": "2.5"}
        refused = completion(gw, 200, sdk)
        assert refused.status_code in (429, 503), refused.text
        assert "retry-after" in refused.headers and "retry-after-ms" in refused.headers
        assert refused.json()["error"]["answer_eta_s"] >= 200 * TOKEN_DELAY_MS / 1000  # what it was told

        def send(name: str, tokens: int, headers: dict[str, str], stream: bool) -> None:
            replies[name] = completion(gw, tokens, headers, stream=stream)

        # while the blocker runs: the same wait said as a queue budget alone (kvgate's header) is a wait for
        # admission; a stream's read timeout runs between its events: 600 tokens (6 s) under a 5 s timeout
        # would leave a whole answer no wait at all, while a stream waits up to 4 s. Both queue, neither is cut
        waiting = [
            threading.Thread(target=send, args=("queued", 200, {"x-kvgate-max-wait-s": "30"}, False)),
            threading.Thread(target=send, args=("streamed", 600, {"x-stainless-read-timeout": "5"}, True)),
        ]
        for thread in waiting:
            thread.start()
        for thread in waiting:
            thread.join()
    finally:
        blocker.join()
    for name in ("queued", "streamed"):
        assert replies[name].status_code == 200, replies[name].text
        assert "x-kvgate-queue-wait-ms" in replies[name].headers, name  # it waited for the blocker
    engine_saw = [r for r in httpx.get(upstream + "/debug/requests").json() if r[:2] == ["POST", "/v1/completions"]]
    assert len(engine_saw) == 8 + 3  # the teaching answers, the blocker, the queued one and the stream
    assert_ledger_empty(gw)
