"""Issue 11's harness pieces, quickly: the class keys for a client's deadline and retry, the ``kvgate-worst``
arm, the retry-after-once policy against a tiny server, reading arms back, the sweep on natural lengths, and
the report's estimator and deadline summaries on hand-made records."""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from loadtests import compare, natural, runner, scenario
from loadtests.bound import closed_loop_capacity
from loadtests.stats import RequestRecord, Sample

SCENARIOS = Path(__file__).resolve().parents[2] / "loadtests" / "scenarios"


def write(tmp_path: Path, **cls: Any) -> scenario.Scenario:
    raw = {
        "name": "t",
        "seed": 1,
        "sim": {"args": ["--preset", "llama3-8b-h100"]},
        "classes": [
            {"name": "c", "prompt_tokens": 100, "max_tokens": 50, "arrival": {"kind": "burst", "count": 3}, **cls}
        ],
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    return scenario.load(path)


def test_wait_budget_and_retry_keys(tmp_path: Path) -> None:
    sc = write(tmp_path, max_wait_s=10, retry="after-once")
    assert all(a.max_wait_s == 10.0 and a.retry_once for a in sc.arrivals())
    plain = write(tmp_path)
    assert all(a.max_wait_s is None and not a.retry_once for a in plain.arrivals())
    assert not write(tmp_path, retry="none").arrivals()[0].retry_once
    with pytest.raises(ValueError, match="retry"):
        write(tmp_path, retry="forever")


def test_deadline_scenario_sends_budget_and_retries() -> None:
    sc = scenario.load(SCENARIOS / "deadline-8b-h100.yaml")
    plan = sc.arrivals()
    assert all(a.max_wait_s == 10.0 and a.retry_once and a.sent_max_tokens is None for a in plan)
    surge = sum(1 for a in plan if a.cls == "surge")
    assert surge > 4 * sum(1 for a in plan if a.cls == "calm")


def test_kvgate_worst_arm_turns_the_estimate_off() -> None:
    sc = scenario.load(SCENARIOS / "chat-natural-8b-h100.yaml")
    worst = compare.gateway_config(sc, "http://x", "kvgate-worst")
    assert worst["admission"]["output_estimate"] == {"enabled": False}
    assert worst["admission"]["queue_max_wait_s"] == 120
    assert "output_estimate" not in compare.gateway_config(sc, "http://x", "kvgate")["admission"]
    assert "kvgate-worst" in compare.ARMS
    with pytest.raises(ValueError, match="unknown arms"):
        compare.compare(sc, ("kvgate-best",), Path("/nonexistent"))
    with pytest.raises(ValueError):
        compare.gateway_config(sc, "http://x", "direct")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def send_to(handler: Handler, arrival: scenario.Arrival, clock: runner.Clock) -> list[RequestRecord]:
    """``runner.send_with_retry`` against a one-route server on a free 127.0.0.1 port, stopped afterwards."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    run = web.AppRunner(app)
    await run.setup()
    site = web.TCPSite(run, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as session:
            return await runner.send_with_retry(session, f"http://127.0.0.1:{port}", arrival, 1, "m", clock, {})
    finally:
        await run.cleanup()


async def test_retry_after_once_and_wait_header() -> None:
    seen: list[dict[str, str]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        if len(seen) == 1:
            body = {"error": {"code": "queue_wait_predicted", "queue_eta_s": 30.0}}
            return web.json_response(body, status=503, headers={"Retry-After": "0.1"})
        resp = web.StreamResponse(headers={"x-kvgate-expected-output-tokens": "7"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        await resp.write(b'data: {"choices": [], "usage": {"completion_tokens": 5}}\n\ndata: [DONE]\n\n')
        return resp

    a = scenario.Arrival(0.0, "c", 3, 5, "completions", None, max_wait_s=10.0, retry_once=True)
    recs = await send_to(handler, a, runner.Clock(0.5))
    assert [r.attempt for r in recs] == [0, 1]
    assert seen[0]["x-kvgate-max-wait-s"] == "5"  # 10 simulated seconds at time scale 0.5
    assert [h["x-stainless-retry-count"] for h in seen] == ["0", "1"]  # numbered as the OpenAI SDKs do
    assert recs[0].status == 503 and recs[0].queue_eta_s == 60.0 and recs[0].waited_s is None
    assert recs[1].ok and recs[1].expected_output == 7 and recs[1].finished is not None
    assert recs[1].sent - recs[0].sent >= 0.1 / 0.5 * 0.9


async def test_no_retry_without_the_policy() -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": "queue_full"}}, status=429, headers={"Retry-After": "0"})

    recs = await send_to(handler, scenario.Arrival(0.0, "c", 3, 5, "completions", None), runner.Clock(1.0))
    assert len(recs) == 1 and recs[0].status == 429


def test_saved_arm_reads_back(tmp_path: Path) -> None:
    rec = RequestRecord(1, "c", None, 0.5, 10, 5, status=200, completion_tokens=5, expected_output=9, attempt=1)
    samples = [Sample(0.0, True, 0.5, estimate_quantile=0.7, outran=2.0), Sample(0.1, False)]
    runner.save(tmp_path / "kvgate", [rec], samples, {"served": 1})
    back = compare.load_arm(tmp_path, "kvgate")
    assert back.records == [rec]
    assert back.samples[0].estimate_quantile == 0.7 and back.samples[0].outran == 2.0
    assert not back.samples[1].up and math.isnan(back.samples[1].kv)
    assert back.summary == {"served": 1}


def test_sweeps_run_on_natural_lengths() -> None:
    sc = scenario.load(SCENARIOS / "mixed-generous-8b-h100.yaml")
    assert sc.natural
    a = sc.draw_mixed(random.Random(0), random.Random(1))
    assert a.output_tokens is not None and a.max_tokens <= (a.sent_max_tokens or 10**9)
    row = closed_loop_capacity(sc, 8, 6.0, 2.0, mixed=True)
    assert row["output_tok_per_s"] > 0 and row["stable"]
    uncapped = scenario.load(SCENARIOS / "chat-natural-8b-h100.yaml")
    assert closed_loop_capacity(uncapped, 8, 6.0, 2.0, largest_class=True)["output_tok_per_s"] > 0


def test_estimator_and_deadline_summaries() -> None:
    recs = [
        RequestRecord(0, "c", None, 0.0, 10, 100, 200, 0.1, 1.0, 100, expected_output=200, finished=1.0),
        RequestRecord(1, "c", None, 0.0, 10, 50, 200, 0.1, 1.0, 50, expected_output=25, finished=2.0),
        RequestRecord(2, "c", None, 0.0, 10, 50, 503, None, 0.01, 0, "queue_wait_predicted", retry_after="2"),
        RequestRecord(2, "c", None, 2.0, 10, 50, 200, 0.2, 1.0, 50, attempt=1, expected_output=50),
        RequestRecord(3, "c", None, 0.0, 10, 50, 503, None, 4.0, 0, "queue_wait_predicted", retry_after="1"),
    ]
    recs[4].waited_s, recs[4].max_wait_s, recs[4].estimated_wait_s = 3.9, 10.0, 2.5
    st = natural.estimator_stats(recs)
    assert st["n"] == 3 and st["ratio_p50"] == 1.0 and st["outran_frac"] == pytest.approx(1 / 3)
    assert st["reserved_over_actual"] == pytest.approx(275 / 200)
    d = natural.deadline_stats(recs)
    assert (d["requests"], d["retries"], d["retries_admitted"], d["refusals"]) == (4, 1, 1, 2)
    assert d["refused_late"] == 1 and d["refused_over_budget"] == 0 and d["refusal_wait_max_s"] == 3.9
    recs[4].estimated_wait_s = 3.0  # told to expect 3 s, refused at 3.9 s: within the slack
    assert natural.deadline_stats(recs)["refused_late"] == 0
