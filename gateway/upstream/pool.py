"""The engines of the pool, at the edge: one scraper and one HTTP client per engine, and DNS discovery.

Each engine is named by its base URL. Its scraper feeds the admitter under that name (the admission core keeps
one set of books per engine); the request path asks :meth:`EnginePool.forwarder` for the client of the engine
its request was placed on. With ``upstream.discovery``, the DNS name is resolved every ``interval_s``: a new
address joins the pool at once (it takes requests from its first good sample on), a vanished one leaves it
(nothing new goes there; its requests in flight finish, then its client is closed). Kubernetes' headless
Service is the registry; there is no other.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.admission.admitter import Admitter
from gateway.config import DiscoveryConfig, GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.protocol.errors import upstream_unavailable
from gateway.tokens.cost import KvGeometry
from gateway.upstream.forwarder import Forwarder
from gateway.upstream.scraper import ModelInfo, Scraper
from gateway.upstream.session import UpstreamSession

log = logging.getLogger("kvgate.pool")

Resolver = Callable[[str, int], Awaitable[list[str]]]
# getaddrinfo's "this name has no address" (NXDOMAIN, or no A/AAAA record): an answer, unlike EAI_AGAIN or
# EAI_FAIL (the lookup itself failed)
_NO_SUCH_NAME = frozenset(
    code
    for code in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None), getattr(socket, "EAI_ADDRFAMILY", None))
    if code is not None
)


async def resolve_addresses(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to, sorted: its IPv4 ones, or its IPv6 ones when it has no IPv4 one.
    Both would name every engine twice (a dual-stack headless Service answers A and AAAA for each pod): two
    books, each seeing half its traffic."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return one_family([(info[0], str(info[4][0])) for info in infos])


def one_family(addresses: list[tuple[int, str]]) -> list[str]:
    """``(family, address)`` pairs to the sorted addresses of one family: IPv4 when there is any, else IPv6."""
    v4 = {address for family, address in addresses if family == socket.AF_INET}
    return sorted(v4 or {address for family, address in addresses if family == socket.AF_INET6})


def engine_url(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"


@dataclass(slots=True)
class Engine:
    url: str
    scraper: Scraper
    forwarder: Forwarder
    task: asyncio.Task[None] | None = field(default=None)


class EnginePool:
    def __init__(
        self,
        config: GatewayConfig,
        admitter: Admitter,
        metrics: GatewayMetrics,
        session: UpstreamSession,
        *,
        geometry_override: KvGeometry | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_model: Callable[[ModelInfo], Awaitable[None]] | None = None,
        resolver: Resolver = resolve_addresses,
    ) -> None:
        self.config = config
        self.admitter = admitter
        self.metrics = metrics
        self.session = session
        self.geometry_override = geometry_override
        self.clock = clock
        self.on_model = on_model
        self.resolver = resolver
        self.engines: dict[str, Engine] = {}
        self._retired: dict[str, Engine] = {}  # left the pool, requests still in flight
        self._running = False
        self._discovery: asyncio.Task[None] | None = None
        self._turn = itertools.count()
        self._model = ModelInfo()  # worked out when an engine comes, goes or says what it serves (_model_changed)
        self._gone_age: Callable[[], float] | None = None  # the age of the latest sample of an engine that left

    # --- membership ---------------------------------------------------------------------------------

    def add(self, url: str) -> Engine:
        url = url.rstrip("/")
        engine = self.engines.get(url) or self._retired.pop(url, None)
        if engine is None:
            up = self.config.upstream
            engine = Engine(
                url,
                Scraper(
                    url,
                    self.session,
                    self.metrics,
                    interval_s=self.config.telemetry.scrape_interval_s,
                    timeout_s=self.config.telemetry.scrape_timeout_s,
                    geometry_override=self.geometry_override,
                    clock=self.clock,
                    on_model=self._model_seen,
                    api_key=up.api_key,
                ),
                Forwarder(
                    url,
                    self.metrics,
                    timeout_s=up.timeout_s,
                    connect_timeout_s=up.connect_timeout_s,
                    max_connections=up.max_connections,
                    max_header_bytes=up.max_response_header_bytes,
                ),
            )
            engine.scraper.subscribe(self.admitter.feed(url))
        self.engines[url] = engine
        self._model_changed()
        self.admitter.controller.add_engine(url)
        if self._running and engine.task is None:
            engine.task = asyncio.create_task(engine.scraper.run(), name=f"kvgate-scraper {url}")
        log.info("engine %s joined the pool (%d engines)", url, len(self.engines))
        return engine

    async def remove(self, url: str) -> None:
        """``url`` left the pool: stop scraping it, place nothing more there; its client closes once the
        requests placed there have ended (see :meth:`_close_retired`)."""
        engine = self.engines.pop(url, None)
        if engine is None:
            return
        self._retired[url] = engine  # first: requests placed there still find its client
        age = engine.scraper.age()
        if age < float("inf") and (self._gone_age is None or age < self._gone_age()):
            self._gone_age = engine.scraper.age  # the pool's metrics are then as old as this one's last sample
        self._model_changed()
        self.admitter.controller.remove_engine(url)
        self.admitter.pump()
        if engine.task is not None:
            engine.task.cancel()
            try:
                await engine.task
            except asyncio.CancelledError:
                pass
            except Exception:  # a scraper that had died: logged, and discovery goes on
                log.exception("the scraper of %s had failed", url)
            engine.task = None
        log.info("engine %s left the pool (%d engines)", url, len(self.engines))
        await self._close_retired()

    async def _close_retired(self) -> None:
        for url in [u for u in self._retired if u not in self.admitter.controller.engines]:
            await self._retired.pop(url).forwarder.close()

    async def _model_seen(self, model: ModelInfo) -> None:
        self._model_changed()
        if self.on_model is not None and self.model.id == model.id:
            await self.on_model(model)

    # --- what the rest of the gateway asks ----------------------------------------------------------

    def forwarder(self, url: str) -> Forwarder:
        """The client of the engine a request was placed on (it may have left the pool meanwhile)."""
        engine = self.engines.get(url) or self._retired.get(url)
        if engine is None:
            raise upstream_unavailable("The engine this request was placed on has left the pool.", 1.0)
        return engine.forwarder

    def any_forwarder(self) -> Forwarder:
        """For a read-only route (and /tokenize): the engines that take requests, in turn: placeable and with a
        fresh sample (an engine that never answered a scrape is not ejected before its third failure); else
        any placeable one, else any."""
        books = self.admitter.controller.engines
        now = self.clock()
        placeable = [e for url, e in self.engines.items() if (b := books.get(url)) is not None and b.placeable]
        fresh = [e for e in placeable if not books[e.url].is_stale(now)]
        candidates = fresh or placeable or list(self.engines.values())
        if not candidates:
            raise upstream_unavailable("No inference engine is in the pool.", 1.0)
        return candidates[next(self._turn) % len(candidates)].forwarder

    def every_forwarder(self) -> list[Forwarder]:
        """For an allow-listed admin call: every engine of the pool, in order, reachable or not (one that
        misses the call is one whose state now differs: the client is told)."""
        return [engine.forwarder for engine in self.engines.values()]

    @property
    def first(self) -> Engine | None:
        return next(iter(self.engines.values()), None)

    @property
    def model(self) -> ModelInfo:
        """What the engines serve (one model per pool): see :meth:`_model_changed`. Read several times per
        request, worked out only when the pool or an engine's answer to /v1/models changes."""
        return self._model

    def _model_changed(self) -> None:
        """The first engine's answer to /v1/models, with the smallest ``max_model_len`` any of them reports:
        mid-way through a rolling update that changes ``--max-model-len`` a request within it fits whichever
        engine it is placed on."""
        known = [e.scraper.model for e in self.engines.values() if e.scraper.model.id is not None]
        if not known:
            self._model = ModelInfo()
            return
        first = known[0]
        shortest = min((m.max_model_len for m in known if m.max_model_len), default=None)
        if shortest is None or shortest == first.max_model_len:
            self._model = first
        else:
            self._model = ModelInfo(first.id, shortest, first.root, first.names)

    @property
    def left_after_a_sample(self) -> bool:
        """An engine that had been sampled has left (the pool was seen working)."""
        return self._gone_age is not None

    def age(self) -> float:
        """Age of the freshest sample of any engine, those that left the pool included (infinite until one was
        sampled): after a rollout to engines not sampled yet, the pool's metrics are as old as the last sample
        of one that left, not unknown."""
        ages = [e.scraper.age() for e in self.engines.values()]
        if self._gone_age is not None:
            ages.append(self._gone_age())
        return min(ages, default=float("inf"))

    @property
    def last_error(self) -> str | None:
        errors = [e.scraper.last_error for e in self.engines.values() if e.scraper.last_error]
        return errors[0] if errors else None

    # --- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        for url in self.config.upstream.static_urls() if self.config.upstream.discovery is None else []:
            self.add(url)
        discovery = self.config.upstream.discovery
        if discovery is not None:
            await self.discover_once(discovery)
        await asyncio.gather(*(e.scraper.scrape_once() for e in self.engines.values()))
        self._running = True
        for engine in self.engines.values():
            engine.task = asyncio.create_task(engine.scraper.run(), name=f"kvgate-scraper {engine.url}")
        if discovery is not None:
            self._discovery = asyncio.create_task(self._discover(discovery), name="kvgate-discovery")

    async def discover_once(self, discovery: DiscoveryConfig) -> None:
        """Resolve the name once and make the pool match the answer. A name that does not exist or has no address
        is an answer: no engine (the cluster DNS answers NXDOMAIN for a headless Service without a ready pod, the
        last engine of a scale-to-zero or of a rollout going away included). A lookup that failed (a timeout,
        a DNS server that is down) changes nothing."""
        try:
            addresses = await self.resolver(discovery.dns, discovery.port)
        except OSError as exc:
            if not (isinstance(exc, socket.gaierror) and exc.errno in _NO_SUCH_NAME):
                log.warning("resolving %s failed: %s (the pool stays as it is)", discovery.dns, exc)
                return
            if self.engines:
                log.warning("%s has no address (%s): every engine leaves the pool", discovery.dns, exc)
            addresses = []
        wanted = {engine_url(discovery.scheme, a, discovery.port) for a in addresses}
        for url in sorted(wanted - self.engines.keys()):
            self.add(url)
        for url in sorted(self.engines.keys() - wanted):
            await self.remove(url)

    async def _discover(self, discovery: DiscoveryConfig) -> None:
        while True:
            await asyncio.sleep(discovery.interval_s)
            await self.discover_once(discovery)
            await self._close_retired()

    async def close(self) -> None:
        tasks = [t for t in [self._discovery, *(e.task for e in self.engines.values())] if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for engine in [*self.engines.values(), *self._retired.values()]:
            await engine.forwarder.close()
        self.engines.clear()
        self._retired.clear()
