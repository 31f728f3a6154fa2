"""Model discovery (``/v1/models``) on an engine run with ``--api-key``: asked with the engine's key, and a
refusal logged once per status instead of dropped silently (or logged every scrape)."""

from __future__ import annotations

import contextlib
import logging
import re
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiohttp import web

from gateway.admission.admitter import Admitter
from gateway.admission.controller import AdmissionController, Rejected
from gateway.config import DiscoveryConfig, GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.tokens.cost import KvGeometry, estimate_cost
from gateway.upstream.pool import EnginePool
from gateway.upstream.scraper import ModelInfo, Scraper
from gateway.upstream.session import UpstreamSession
from tests.support.procs import free_port

KEY = "engine-secret"
REFERENCE = Path(__file__).parents[1] / "sim" / "reference"


class GuardedModels:
    """``/v1/models`` behind vLLM's bearer check; ``status`` overrides the answer (an engine in trouble)."""

    def __init__(self) -> None:
        self.seen: list[str | None] = []
        self.status: int | None = None

    async def models(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(request.headers.get("authorization"))
        if self.status is not None:
            return web.Response(status=self.status)
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        models = [
            {"id": "m", "max_model_len": 2048, "root": "/models/m", "parent": None},
            {"id": "m-alias", "max_model_len": 2048, "root": "/models/m", "parent": None},
            {"id": "a-lora", "max_model_len": 2048, "root": "/adapters/a", "parent": "m"},
        ]
        return web.json_response({"data": models})


@pytest.fixture
async def engine() -> AsyncIterator[tuple[GuardedModels, str]]:
    guarded = GuardedModels()
    app = web.Application()
    app.router.add_get("/v1/models", guarded.models)
    async with served(app) as url:
        yield guarded, url


@contextlib.asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[str]:
    """``app`` on a free local port, its URL; stopped afterwards."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def scraper() -> AsyncIterator[Callable[..., Scraper]]:
    session = UpstreamSession(4)

    def make(url: str, **kw: object) -> Scraper:
        return Scraper(url, session, GatewayMetrics(), interval_s=1.0, timeout_s=2.0, **kw)  # type: ignore[arg-type]

    yield make
    await session.close()


async def test_discovery_sends_the_engines_api_key(
    engine: tuple[GuardedModels, str], scraper: Callable[..., Scraper]
) -> None:
    guarded, url = engine
    seen: list[ModelInfo] = []

    async def on_model(model: ModelInfo) -> None:
        seen.append(model)

    s = scraper(url, api_key=KEY, on_model=on_model)
    await s.discover_model()
    # the base model's names (what a request without a model runs on), not the adapters'
    assert s.model == ModelInfo("m", 2048, "/models/m", ("m", "m-alias")) and seen == [s.model]
    assert guarded.seen == [f"Bearer {KEY}"]


async def test_a_refused_discovery_is_logged_once_per_status(
    engine: tuple[GuardedModels, str], scraper: Callable[..., Scraper], caplog: pytest.LogCaptureFixture
) -> None:
    guarded, url = engine
    s = scraper(url)  # no key: vLLM's 401
    with caplog.at_level(logging.WARNING, logger="kvgate.scraper"):
        for _ in range(3):
            await s.discover_model()
        guarded.status = 503
        for _ in range(2):
            await s.discover_model()
    assert s.model == ModelInfo() and guarded.seen == [None] * 5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "HTTP 401" in warnings[0] and "upstream.api_key" in warnings[0]
    assert "HTTP 503" in warnings[1] and "upstream.api_key" not in warnings[1]


async def test_a_pool_mid_way_through_a_max_model_len_change_admits_what_fits_every_engine() -> None:
    """Engines that say different context lengths (a rolling update of ``--max-model-len``): the pool's is the
    shortest, so no request is priced for a context the engine it lands on would refuse."""
    config = GatewayConfig()
    admitter = Admitter(AdmissionController(config.admission, engines=()), GatewayMetrics(), lambda: 0.0)
    pool = EnginePool(config, admitter, GatewayMetrics(), UpstreamSession(4))
    a, b = pool.add("http://a"), pool.add("http://b")
    assert pool.model == ModelInfo()

    async def answers(engine, model: ModelInfo) -> None:  # type: ignore[no-untyped-def]
        engine.scraper.model = model  # as the scraper does on each answer to /v1/models, then tells the pool
        await pool._model_seen(model)

    await answers(b, ModelInfo("m", 8192, "/models/m", ("m",)))
    assert pool.model == ModelInfo("m", 8192, "/models/m", ("m",))
    await answers(a, ModelInfo("m", 4096, "/models/m", ("m",)))
    assert pool.model == ModelInfo("m", 4096, "/models/m", ("m",))
    await answers(a, ModelInfo("m", 16384, "/models/m", ("m",)))
    assert pool.model.max_model_len == 8192
    await pool.remove("http://b")  # the shorter one leaves: the pool's is the one left
    assert pool.model.max_model_len == 16384


async def test_an_engine_that_restarts_is_asked_again_what_it_serves(scraper: Callable[..., Scraper]) -> None:
    """A sidecar's engine restarted on the same address with a longer --max-model-len (its process start time
    changed), or answered again after failing: its /v1/models is read again, not kept from its first answer
    (kvgate refused what now fits, and priced a chat without max_tokens at the old context's rest)."""
    state = {"started": 1000.0, "max_model_len": 2048, "up": True, "models_up": True}

    async def metrics(_: web.Request) -> web.Response:
        if not state["up"]:
            return web.Response(status=503)
        text = (REFERENCE / "metrics-sample.txt").read_text()
        text = re.sub(
            r"^process_start_time_seconds .*$", f"process_start_time_seconds {state['started']}", text, flags=re.M
        )
        return web.Response(text=text)

    async def models(_: web.Request) -> web.Response:
        if not state["models_up"]:
            return web.Response(status=500)
        return web.json_response({"data": [{"id": "m", "max_model_len": state["max_model_len"], "parent": None}]})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    async with served(app) as url:
        s = scraper(url)
        assert await s.scrape_once() and s.model.max_model_len == 2048
        state["max_model_len"] = 300_000
        assert await s.scrape_once() and s.model.max_model_len == 2048  # the same process: not asked again
        state["started"], state["models_up"] = 2000.0, False  # restarted between two scrapes, not quite up
        assert await s.scrape_once() and s.model.max_model_len == 2048
        state["models_up"] = True  # asked again until it answers, not once
        assert await s.scrape_once() and s.model.max_model_len == 300_000
        state["up"], state["max_model_len"] = False, 4096
        assert not await s.scrape_once()
        state["up"] = True  # back after failing (its start time may not say so: a sample it never showed)
        assert await s.scrape_once() and s.model.max_model_len == 4096


async def test_a_scrape_says_whether_the_engine_refused_the_connection(
    scraper: Callable[..., Scraper], engine: tuple[GuardedModels, str]
) -> None:
    """Nothing listening (a dead engine) is told apart from an answer that fails (here a 404 for /metrics: an
    engine that is up), so a pool refuses requests at once only when its engines are down."""
    told: list[bool] = []

    class Listener:
        def scrape_started(self) -> None: ...

        def sample(self, sample: object) -> None: ...

        def scrape_failed(self, refused: bool = False) -> None:
            told.append(refused)

    for url in (f"http://127.0.0.1:{free_port()}", engine[1]):
        s = scraper(url)
        s.subscribe(Listener())  # type: ignore[arg-type]
        assert not await s.scrape_once()
    assert told == [True, False]


async def test_a_name_without_addresses_empties_the_pool_and_a_failed_lookup_keeps_it() -> None:
    """The cluster DNS answers NXDOMAIN for a headless Service with no ready pod: that is an answer (no engine),
    and a new request is told to come back instead of going to the pod that is shutting down. A lookup that
    failed (EAI_AGAIN: the DNS server did not answer) keeps the pool as it is."""
    answers: list[list[str] | BaseException] = [
        ["10.0.0.1", "10.0.0.2"],
        socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
        socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
        ["10.0.0.3"],
    ]

    async def resolver(host: str, port: int) -> list[str]:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    config = GatewayConfig()
    discovery = DiscoveryConfig(dns="vllm-engines.llm.svc.cluster.local", port=8000)
    controller = AdmissionController(config.admission, engines=())
    admitter = Admitter(controller, GatewayMetrics(), lambda: 0.0)
    pool = EnginePool(config, admitter, GatewayMetrics(), UpstreamSession(4), resolver=resolver)
    await pool.discover_once(discovery)
    assert sorted(pool.engines) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    await pool.discover_once(discovery)
    assert len(pool.engines) == 2
    await pool.discover_once(discovery)
    assert pool.engines == {} and controller.engines == {}
    cost = estimate_cost(
        (100,), max_tokens=100, sequences_per_prompt=1, max_model_len=None, geometry=KvGeometry(16, 1000)
    )
    decision = controller.submit(cost, "t", now=0.0)
    assert isinstance(decision, Rejected) and decision.reason == "no_engine" and decision.retry_after_s == 1.0
    await pool.discover_once(discovery)
    assert list(pool.engines) == ["http://10.0.0.3:8000"]
    await pool.close()


class Faulty:
    """A subscriber whose every call raises, and one that counts what it was told."""

    def __init__(self) -> None:
        self.told: list[str] = []

    def scrape_started(self) -> None:
        self.told.append("started")
        raise RuntimeError("a bug in a subscriber")

    def scrape_failed(self, refused: bool) -> None:
        self.told.append("failed")
        raise RuntimeError("a bug in a subscriber")

    def sample(self, sample: object) -> None:
        self.told.append("sample")
        raise RuntimeError("a bug in a subscriber")


async def test_a_subscriber_that_raises_does_not_end_the_scrapes(
    scraper: Callable[..., Scraper], caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing restarts an engine's scrape loop: an exception from a subscriber (a NaN that broke a decision,
    a bug) is logged, and the next subscriber and the next scrape are still told, whether the scrape failed
    or brought a sample."""
    metrics = (REFERENCE / "metrics-sample.txt").read_text()
    answering = {"up": False}

    async def serve_metrics(_: web.Request) -> web.Response:
        return web.Response(text=metrics) if answering["up"] else web.Response(status=503)

    app = web.Application()
    app.router.add_get("/metrics", serve_metrics)
    async with served(app) as url:
        s = scraper(url)
        faulty, counting = Faulty(), Faulty()
        s.subscribers += [faulty, counting]
        with caplog.at_level(logging.ERROR, logger="kvgate"):
            assert await s.scrape_once() is False
            answering["up"] = True
            assert await s.scrape_once() is True
        assert counting.told == ["started", "failed", "started", "sample"]
        assert sum("a subscriber's" in r.getMessage() for r in caplog.records) == 8
