"""SIGTERM mid-stream, as Kubernetes sends it after the preStop hook: the drain the manifests budget for.

A real gateway process in front of the mini vLLM server, with the engine full so that a second request is
waiting in kvgate's queue: the in-flight stream completes, the queued request and a new one get 503 with
Retry-After, and the process exits as soon as the stream is done, well within --drain-timeout.
tests/integration/test_shutdown.py covers the drain deadline cutting off a stream that would not end.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

procs_mod = pytest.importorskip("tests.support.procs", reason="tests/support/procs.py not importable")
promtext = pytest.importorskip("tests.support.promtext", reason="tests/support/promtext.py not importable")

pytestmark = pytest.mark.e2e

TOKEN_DELAY_MS = 20
STREAM_TOKENS = 120  # about 2.4 s of streaming: SIGTERM lands well inside it
DRAIN_TIMEOUT_S = 20


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, object] | str]:
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else orjson.loads(data)


def test_sigterm_mid_stream_drains_then_exits(procs: list[object]) -> None:
    # 16 blocks of 16 tokens: the stream reserves 8 blocks, so a second request of 8 blocks must queue
    # (projected 16/16 > the 0.90 high watermark).
    engine = procs_mod.start_mini_vllm(token_delay_ms=TOKEN_DELAY_MS, num_blocks=16, block_size=16, max_model_len=256)
    procs.append(engine)
    gw = procs_mod.start_gateway(
        engine.url, {"tokenizer": "heuristic"}, extra_args=["--drain-timeout", str(DRAIN_TIMEOUT_S)]
    )
    procs.append(gw)
    url = gw.url

    queued: dict[str, httpx.Response] = {}

    def waiting_request() -> None:
        with httpx.Client(timeout=30) as c:
            queued["resp"] = c.post(url + "/v1/completions", json={"model": "mini", "prompt": "x", "max_tokens": 120})

    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST",
            url + "/v1/completions",
            json={"model": "mini", "prompt": "hi", "max_tokens": STREAM_TOKENS, "stream": True},
        ) as stream,
    ):
        assert stream.status_code == 200
        events = sse_events(stream.iter_lines())
        first = next(events)
        assert isinstance(first, dict)
        waiter = threading.Thread(target=waiting_request)
        waiter.start()
        # Let the second request reach the queue: the gateway reports it in kvgate_queue_depth.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if promtext.metric_sum(promtext.scrape(url), "kvgate_queue_depth", default=0.0) == 1:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the second request never queued")

        sigterm_at = time.monotonic()
        gw.signal(signal.SIGTERM)
        waiter.join(timeout=10)
        resp = queued["resp"]
        assert resp.status_code == 503, resp.text
        assert int(resp.headers["retry-after"]) >= 1
        assert resp.json()["error"]

        # kvgate keeps listening while it drains, so a new request is told to go elsewhere, not refused.
        late = httpx.post(url + "/v1/completions", json={"model": "mini", "prompt": "y", "max_tokens": 4}, timeout=5)
        assert late.status_code == 503 and "retry-after" in late.headers, late.text
        assert httpx.get(url + "/readyz", timeout=5).status_code == 503

        rest = list(events)
    assert rest[-1] == "[DONE]", "the in-flight stream was cut"
    tokens = [e for e in [first, *rest] if isinstance(e, dict) and e.get("choices")]
    assert len(tokens) == STREAM_TOKENS

    gw.popen.wait(timeout=DRAIN_TIMEOUT_S + 10)
    took = time.monotonic() - sigterm_at
    # uvicorn re-raises the SIGTERM it caught once shutdown is complete: exit status 143 is a clean drain.
    assert gw.popen.returncode in (0, -signal.SIGTERM), gw.log_tail()
    assert "Application shutdown complete" in gw.log()
    # It waited for the stream (about 2.4 s from its start), not for the whole deadline.
    assert took < DRAIN_TIMEOUT_S / 2, f"exit took {took:.1f}s"
