"""A client that reads its answer in one piece under a read timeout (the OpenAI SDK) must get all of it within
that timeout, not only be admitted within it: kvgate keeps the time the answer will take out of the wait it
allows, and refuses at once, with a Retry-After, what would be admitted too late to be answered."""

from __future__ import annotations

import threading
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
    body = {"model": "mini", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    return httpx.post(gw + "/v1/completions", json=body, headers=headers, timeout=120)


def test_a_whole_answer_that_could_not_arrive_within_the_read_timeout_is_refused_at_once(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    upstream = mini_vllm(num_blocks=64, block_size=16, token_delay_ms=TOKEN_DELAY_MS)
    gw = gateway(upstream, CONFIG)
    for _ in range(8):  # the pace of answers: 20 tokens in ~0.2 s each
        assert completion(gw, 20, {}).status_code == 200
    # a stream that holds most of the pool for ~1 s (100 tokens): what comes next waits for it
    blocker = threading.Thread(target=completion, args=(gw, 100, {}, "x" * 2800, True))
    blocker.start()
    try:
        while scrape(gw).get("kvgate_reserved_blocks", 0.0) < 40:
            pass
        # 200 tokens take ~2 s once admitted; the SDK's read timeout of 2.5 s leaves it 1.5 s, less 2 s to wait:
        # admitted when the blocker ends, it would time out mid-answer
        sdk = {"x-stainless-read-timeout": "2.5"}
        refused = completion(gw, 200, sdk)
        assert refused.status_code in (429, 503), refused.text
        assert "retry-after" in refused.headers and "retry-after-ms" in refused.headers
        assert refused.json()["error"]["answer_eta_s"] >= 200 * TOKEN_DELAY_MS / 1000  # what it was told
        # the same wait, said as a queue budget alone (kvgate's header), is a wait for admission: it queues
        queued = completion(gw, 200, {"x-kvgate-max-wait-s": "30"})
        assert queued.status_code == 200 and "x-kvgate-queue-wait-ms" in queued.headers
        # a stream's read timeout runs between events, not over the whole answer: it queues as well
        streamed = completion(gw, 200, sdk, stream=True)
        assert streamed.status_code == 200
    finally:
        blocker.join()
    engine_saw = [r for r in httpx.get(upstream + "/debug/requests").json() if r[:2] == ["POST", "/v1/completions"]]
    assert len(engine_saw) == 8 + 3  # the teaching answers, the blocker, the queued one and the stream
    assert_ledger_empty(gw)
