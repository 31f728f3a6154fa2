"""Requests stop at their natural length (EOS) with vLLM's semantics; scenarios plan those lengths.

Natural lengths are what reserving by expected output will be judged on, so each piece is pinned here: the
engine's stop rule (EOS before the length cap, ``ignore_eos``, the ``min_tokens`` floor, recompute after
preemption), the distributions' shapes, the HTTP surface, and the scenario keys that drive it all.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from pathlib import Path

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.sim.api import SIM_OUTPUT_FIELD, token_text
from gateway.sim.cli import build_parser, config_from_args
from gateway.sim.config import PRESETS, SimConfig
from gateway.sim.engine import Engine, SimRequest, Status
from gateway.sim.lengths import Fixed, LogNormal, Uniform, parse_lengths
from loadtests import runner, scenario
from tests.sim.conftest import StartSim
from tests.support.promtext import metric_sum, parse_metrics

MODEL = "llama3-8b"


def small(**kw: object) -> SimConfig:
    """The tiny pool of test_engine.py: 10 allocatable blocks of 16 tokens, 64-token steps."""
    base = dataclasses.replace(
        PRESETS["llama3-8b-h100"], num_gpu_blocks=11, max_model_len=160, max_num_batched_tokens=64, max_num_seqs=8
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def drain(eng: Engine) -> dict[str, list[int]]:
    """Run to completion; the token indices each request produced, in order."""
    seen: dict[str, list[int]] = {}
    now = 0.0
    while eng.has_work():
        step = eng.schedule(now)
        now += step.duration
        for ev in eng.complete(step, now):
            seen.setdefault(ev.request.request_id, []).append(ev.index)
    return seen


def finish(prompt: int = 20, max_tokens: int = 30, **kw: object) -> tuple[str | None, int]:
    eng = Engine(small())
    req = SimRequest("r", prompt, max_tokens, 0.0, **kw)  # type: ignore[arg-type]
    eng.add(req)
    drain(eng)
    return req.finish_reason, req.num_output


# -- the engine's stop rule ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, ("length", 30)),  # no natural length: today's behaviour
        ({"output_tokens": 7}, ("stop", 7)),
        ({"output_tokens": 1}, ("stop", 1)),
        ({"output_tokens": 31}, ("length", 30)),
        ({"output_tokens": 30}, ("stop", 30)),  # EOS as the last allowed token: check_stop tests EOS first
        ({"output_tokens": 7, "ignore_eos": True}, ("length", 30)),
        ({"output_tokens": 3, "min_tokens": 8}, ("stop", 9)),  # EOS masked for the first 8 tokens
        ({"output_tokens": 12, "min_tokens": 8}, ("stop", 12)),  # above the floor: unchanged
        ({"output_tokens": 3, "min_tokens": 30}, ("length", 30)),  # the floor is the cap: never stops
        ({"output_tokens": 3, "min_tokens": 8, "ignore_eos": True}, ("length", 30)),
    ],
)
def test_finish_reason_and_count(kw: dict[str, object], expected: tuple[str, int]) -> None:
    assert finish(**kw) == expected


def test_context_end_is_length_even_with_a_later_natural_stop() -> None:
    assert finish(prompt=150, max_tokens=10, output_tokens=50) == ("length", 10)  # 150 + 10 = max_model_len


def test_stop_is_counted_in_metrics_stats() -> None:
    eng = Engine(small())
    eng.add(SimRequest("a", 20, 30, 0.0, output_tokens=4))
    eng.add(SimRequest("b", 20, 6, 0.0, output_tokens=40))
    drain(eng)
    assert eng.stats.finished_by_reason == {"stop": 1, "length": 1}
    assert eng.stats.generation_tokens == 4 + 6
    assert eng.pool.used == 0


def test_preempted_request_recomputes_and_stops_at_the_same_length() -> None:
    # test_engine.py's preemption: two 64-token prompts fill 8 of 10 blocks, decode grows both, and "new" is
    # preempted by recompute. Its natural length (70) lies beyond the preemption, so it must resume and stop
    # exactly there, having produced every index once.
    eng = Engine(small(max_num_batched_tokens=128))
    eng.add(SimRequest("old", 64, 90, 0.0, output_tokens=80))
    eng.add(SimRequest("new", 64, 90, 0.0, output_tokens=70))
    new = eng.requests["new"]
    seen = drain(eng)
    assert new.num_preemptions >= 1
    assert (new.finish_reason, new.num_output) == ("stop", 70)
    assert seen["new"] == list(range(1, 71))
    assert seen["old"] == list(range(1, 81))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 100),  # prompt
            st.integers(1, 60),  # max_tokens
            st.one_of(st.none(), st.integers(1, 80)),  # natural length
            st.integers(0, 10),  # min_tokens
            st.booleans(),  # ignore_eos
        ),
        min_size=1,
        max_size=12,
    )
)
def test_every_request_ends_where_vllm_would_under_preemption(
    reqs: list[tuple[int, int, int | None, int, bool]],
) -> None:
    """Random traffic on a pool that forces preemption: each request ends at min(stop, cap) regardless."""
    cfg = small(max_num_batched_tokens=48)
    eng = Engine(cfg)
    added = []
    for i, (prompt, cap, natural, min_tokens, ignore_eos) in enumerate(reqs):
        cap = min(cap, cfg.max_model_len - prompt)
        req = SimRequest(str(i), prompt, cap, 0.0, natural, min(min_tokens, cap), ignore_eos)
        eng.add(req)
        added.append(req)
    drain(eng)
    for req in added:
        assert req.status is Status.FINISHED
        stop = None if req.ignore_eos or req.output_tokens is None else max(req.output_tokens, req.min_tokens + 1)
        if stop is not None and stop <= req.max_tokens:
            assert (req.finish_reason, req.num_output) == ("stop", stop)
        else:
            assert (req.finish_reason, req.num_output) == ("length", req.max_tokens)
    assert eng.pool.used == 0


# -- distributions ---------------------------------------------------------------------------------------------
def test_lognormal_median_and_p99_match_the_spec() -> None:
    dist = parse_lengths("lognormal:median=250,p99=2000")
    rng = random.Random(0)
    draws = sorted(dist.draw(rng) for _ in range(50_000))
    median = statistics.median(draws)
    p99 = draws[int(0.99 * len(draws))]
    assert median == pytest.approx(250, rel=0.03)
    assert p99 == pytest.approx(2000, rel=0.06)
    assert min(draws) >= 1


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("fixed:200", Fixed(200)),
        ("200", Fixed(200)),
        (200, Fixed(200)),
        ("uniform:100-500", Uniform(100, 500)),
        ("100-500", Uniform(100, 500)),
        ("lognormal:median=300,p99=2000", LogNormal(300, 2000)),
    ],
)
def test_spec_syntax(spec: str | int, expected: object) -> None:
    assert parse_lengths(spec) == expected
    assert parse_lengths(str(expected)) == expected  # str() gives the spec back


@pytest.mark.parametrize(
    "spec",
    ["", "fixed:0", "uniform:5-2", "lognormal:median=300", "lognormal:median=300,p99=200", "poisson:3", "a-b", True],
)
def test_bad_specs_are_refused(spec: str | bool) -> None:
    with pytest.raises(ValueError, match=r"output length spec|fixed output length"):
        parse_lengths(spec)


def test_uniform_and_fixed_draws_stay_in_range() -> None:
    rng = random.Random(1)
    draws = {Uniform(3, 6).draw(rng) for _ in range(200)}
    assert draws == {3, 4, 5, 6}
    assert Fixed(9).draw(rng) == 9


def test_cli_flags() -> None:
    cfg = config_from_args(build_parser().parse_args(["--output-tokens", "lognormal:median=300,p99=2000"]))
    assert cfg.output_tokens == LogNormal(300, 2000) and cfg.seed == 0
    cfg = config_from_args(build_parser().parse_args(["--output-tokens", "7", "--seed", "4"]))
    assert (cfg.output_tokens, cfg.seed) == (Fixed(7), 4)
    assert config_from_args(build_parser().parse_args([])).output_tokens is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--output-tokens", "lognormal:p99=3"])


# -- HTTP ----------------------------------------------------------------------------------------------------
def test_http_finish_reasons_usage_and_server_distribution(sim: StartSim) -> None:
    proc = sim("--time-scale", "0.02", "--kv-scale", "0.05", "--output-tokens", "uniform:1-40", "--seed", "3")
    with httpx.Client(base_url=proc.url, timeout=60) as client:

        def complete(**body: object) -> httpx.Response:
            return client.post("/v1/completions", json={"model": MODEL, "prompt": list(range(50)), **body})

        r = complete(max_tokens=20, **{SIM_OUTPUT_FIELD: 5}).json()
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"] == {"prompt_tokens": 50, "completion_tokens": 5, "total_tokens": 55}
        assert r["choices"][0]["text"] == " the quick brown fox"  # the EOS token is counted, not shown
        r = complete(max_tokens=20, **{SIM_OUTPUT_FIELD: 50}).json()
        assert (r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]) == ("length", 20)
        r = complete(max_tokens=20, ignore_eos=True, **{SIM_OUTPUT_FIELD: 5}).json()
        assert (r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]) == ("length", 20)
        r = complete(max_tokens=20, min_tokens=10, **{SIM_OUTPUT_FIELD: 5}).json()
        assert (r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]) == ("stop", 11)

        # Streaming chat: the tokens' text (the EOS has none), finish_reason stop on the last event; usage agrees.
        # How many events carry them depends on how fast this reader takes them (vLLM merges what waits).
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello " * 30}],
            "max_tokens": 20,
            "stream": True,
            "stream_options": {"include_usage": True},
            SIM_OUTPUT_FIELD: 6,
        }
        events = []
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(orjson.loads(line[6:]))
        content = [e for e in events if e["choices"]]
        assert content.pop(0)["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # vLLM's first event
        assert "".join(e["choices"][0]["delta"]["content"] for e in content) == "".join(map(token_text, range(1, 6)))
        assert [e["choices"][0]["finish_reason"] for e in content] == [None] * (len(content) - 1) + ["stop"]
        assert events[-1]["usage"]["completion_tokens"] == 6

        # Without the body field the server's --output-tokens decides, seeded: draws in arrival order.
        rng = random.Random(3)
        expected = [Uniform(1, 40).draw(rng) for _ in range(5)]
        got = [complete(max_tokens=100).json()["usage"]["completion_tokens"] for _ in range(5)]
        assert got == expected

        for bad in ({SIM_OUTPUT_FIELD: 0}, {SIM_OUTPUT_FIELD: "5"}, {"min_tokens": 30}, {"ignore_eos": "yes"}):
            resp = complete(max_tokens=20, **bad)
            assert resp.status_code == 400, bad
            assert resp.json()["error"]["param"] in (SIM_OUTPUT_FIELD, "min_tokens", "ignore_eos")
        text = client.get("/metrics").text
    stops = metric_sum(parse_metrics(text), "vllm:request_success_total", finished_reason="stop")
    assert stops == 1 + 1 + 1 + 5  # 5-token, min_tokens, chat stream, and the five drawn ones
    assert metric_sum(parse_metrics(text), "vllm:request_success_total", finished_reason="length") == 2


# -- scenarios -----------------------------------------------------------------------------------------------
SCENARIO = """
name: t
seed: 7
sim:
  args: [--preset, llama3-8b-h100, --max-model-len, "4096"]
classes:
  - name: legacy
    arrival: {kind: burst, count: 30, at: 0}
    prompt_tokens: {min: 100, max: 200}
    max_tokens: {min: 20, max: 40}
  - name: open
    api: chat
    arrival: {kind: poisson, rate: 50, start: 0, stop: 4}
    prompt_tokens: 300-600
    output_tokens: lognormal:median=250,p99=2000
  - name: capped
    arrival: {kind: burst, count: 200, at: 1}
    prompt_tokens: 100
    max_tokens: "200-800"
    output_tokens: 100-500
  - name: fixed-cap
    arrival: {kind: burst, count: 5, at: 2}
    prompt_tokens: 100
    max_tokens: 1536
    output_tokens: fixed:2000
"""


def load(tmp_path: Path, text: str = SCENARIO) -> scenario.Scenario:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return scenario.load(path)


def test_scenario_keys(tmp_path: Path) -> None:
    sc = load(tmp_path)
    cls = {c.name: c for c in sc.classes}
    assert cls["legacy"].output_tokens is None and cls["legacy"].max_tokens == scenario.Range(20, 40)
    assert cls["open"].max_tokens is None and cls["open"].output_tokens == LogNormal(250, 2000)
    assert cls["capped"].max_tokens == scenario.Range(200, 800) and cls["capped"].output_tokens == Uniform(100, 500)
    assert cls["fixed-cap"].max_tokens == scenario.Range(1536, 1536)
    assert sc.max_model_len == 4096

    plan = sc.arrivals()
    assert plan == sc.arrivals()
    by = {name: [a for a in plan if a.cls == name] for name in cls}
    for a in by["legacy"]:
        body = runner.request_body(a, MODEL, 0)
        assert body["ignore_eos"] is True and body["max_tokens"] == a.max_tokens and SIM_OUTPUT_FIELD not in body
    for a in by["open"]:
        body = runner.request_body(a, MODEL, 0)
        assert "max_tokens" not in body and "ignore_eos" not in body
        assert a.output_tokens is not None and body[SIM_OUTPUT_FIELD] == a.output_tokens
        assert a.max_tokens == min(a.output_tokens, 4096 - a.prompt_tokens)  # what a served response carries
    caps = [a.sent_max_tokens for a in by["capped"]]
    assert all(c is not None and 200 <= c <= 800 for c in caps) and len(set(caps)) > 50
    for a in by["capped"]:
        body = runner.request_body(a, MODEL, 0)
        assert body["max_tokens"] == a.sent_max_tokens and body[SIM_OUTPUT_FIELD] == a.output_tokens
        assert a.output_tokens is not None and a.sent_max_tokens is not None
        assert a.max_tokens == min(a.output_tokens, a.sent_max_tokens)
    assert any(a.max_tokens < (a.sent_max_tokens or 0) for a in by["capped"])  # some stop before the cap
    for a in by["fixed-cap"]:
        assert (a.output_tokens, a.sent_max_tokens, a.max_tokens) == (2000, 1536, 1536)
    naturals = sorted(a.output_tokens for a in by["open"] if a.output_tokens is not None)
    assert len(naturals) > 100 and 150 < statistics.median(naturals) < 350


def test_natural_lengths_do_not_move_the_rest_of_the_plan(tmp_path: Path) -> None:
    """Natural lengths have their own generator: the same traffic with and without them."""
    with_lengths = load(tmp_path).arrivals()
    without = load(tmp_path, SCENARIO.replace("    output_tokens: 100-500\n", "")).arrivals()
    assert [(a.at, a.cls, a.prompt_tokens, a.sent_max_tokens) for a in with_lengths] == [
        (a.at, a.cls, a.prompt_tokens, a.sent_max_tokens) for a in without
    ]
    capped = [a for a in without if a.cls == "capped"]
    assert all(a.output_tokens is None and a.max_tokens == a.sent_max_tokens for a in capped)


def test_range_strings() -> None:
    assert scenario.Range.parse("200-800") == scenario.Range(200, 800)
    assert scenario.Range.parse("1536") == scenario.Range(1536, 1536)
    assert scenario.Range.parse(1536) == scenario.Range(1536, 1536)
    assert scenario.Range.parse({"min": 1, "max": 2}) == scenario.Range(1, 2)
