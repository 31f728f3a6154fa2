"""SIGTERM in the middle of a stream: the stream completes, new requests get 503, the process exits in time."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.support.procs import Proc

pytestmark = pytest.mark.e2e


def test_sigterm_drains_in_flight_streams(
    mini_vllm: Callable[..., str], gateway: Callable[..., str], procs: list[Proc]
) -> None:
    upstream = mini_vllm(token_delay_ms=20)
    gw = gateway(upstream, {"tokenizer": "heuristic"}, extra_args=["--drain-timeout", "20"])
    gw_proc = procs[-1]
    events: list[str] = []

    def stream() -> None:
        body = {"prompt": "x", "max_tokens": 100, "stream": True}
        with httpx.stream("POST", gw + "/v1/completions", json=body, timeout=30) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    reader = threading.Thread(target=stream)
    reader.start()
    while httpx.get(upstream + "/debug/stats").json()["active"] == 0:
        time.sleep(0.01)
    signalled = time.monotonic()
    gw_proc.signal(signal.SIGTERM)
    time.sleep(0.2)
    refused = httpx.post(gw + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert "retry-after" in refused.headers
    assert httpx.get(gw + "/readyz").status_code == 503
    reader.join(30)
    assert len(events) == 101 and events[-1] == "data: [DONE]"  # 100 tokens then [DONE]: the stream completed
    gw_proc.popen.wait(20)
    exited_after = time.monotonic() - signalled
    assert gw_proc.popen.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    assert exited_after < 20  # the drain deadline
    assert httpx.get(upstream + "/debug/stats").json()["completed"] == 1


def test_drain_deadline_cuts_off_a_stream_that_would_not_end(
    mini_vllm: Callable[..., str], gateway: Callable[..., str], procs: list[Proc]
) -> None:
    upstream = mini_vllm(token_delay_ms=100)
    gw = gateway(upstream, {"tokenizer": "heuristic"}, extra_args=["--drain-timeout", "1"])
    gw_proc = procs[-1]
    body = {"prompt": "x", "max_tokens": 3000, "stream": True}  # would take 300 s

    lines: list[str] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", gw + "/v1/completions", json=body, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line)
        except httpx.HTTPError:
            pass

    reader = threading.Thread(target=stream)
    reader.start()
    while httpx.get(upstream + "/debug/stats").json()["active"] == 0:
        time.sleep(0.01)
    gw_proc.signal(signal.SIGTERM)
    gw_proc.popen.wait(30)
    reader.join(10)
    stats = httpx.get(upstream + "/debug/stats").json()
    assert stats["active"] == 0 and len(stats["cancelled"]) == 1  # the engine was told to stop generating
    # the client is told its answer was cut off, not left to take a short stream for a whole one
    assert lines and json.loads(lines[-1].removeprefix("data: "))["error"]["code"] == "shutting_down"
