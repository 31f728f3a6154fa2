"""The asyncio shell around :class:`~gateway.admission.controller.AdmissionController`.

It parks queued requests on futures, wakes them when capacity frees up (a new sample, a finished request),
fails them at their deadline, and never loses a reservation: a request that is cancelled in the instant it gets
admitted hands its reservation straight back, and :meth:`Admitter.release` releases one exactly once (the
request's :class:`~gateway.server.exchange.Exchange` calls it when the request ends, however it ends).

It subscribes to the scraper's samples (:meth:`scrape_started`, :meth:`sample`, :meth:`scrape_failed`). Its
gauges are read from the controller's state at scrape time, never pushed from here; rejections are counted
where the client is answered.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.admission.affinity import prefix_chain
from gateway.admission.controller import DEFAULT_ENGINE, AdmissionController, Admitted, Queued, UsageSample
from gateway.admission.engine import SampleMark
from gateway.admission.ledger import Reservation
from gateway.admission.queue import PRIORITIES, STANDARD, QueueClass, Ticket
from gateway.metrics import GatewayMetrics
from gateway.protocol.errors import GatewayError, queue_full, queue_timeout, upstream_unavailable, wait_predicted
from gateway.protocol.prompt_prefix import leading_bytes
from gateway.protocol.requests import InferenceRequest
from gateway.tokens.cost import RequestCost

# Releases that are not a request finishing on the engine: they say nothing of the rate the line moves at.
NOT_FINISHED = frozenset({"claim_refused", "claim_unanswered", "engine_unreachable", "upstream_busy"})
NO_ENGINE = "No engine of the pool is taking requests now (each is down, restarting or leaving, or none is left)."


class SharedBooks(Protocol):
    """Blocks in flight per engine, shared with the other gateway replicas (see
    :mod:`gateway.tenants.shared_books`). ``mark``: the sample this replica's view of the engine rests on; the
    other replicas' claims are summed as that sample sees them. None from either call: the shared books
    cannot say right now."""

    async def claim(
        self,
        engine: str,
        member: str,
        blocks: int,
        limit: int,
        mark: SampleMark | None,
        waited_s: float = 0.0,
        priority: int = STANDARD,
    ) -> tuple[bool, int] | None:
        """Claim ``blocks`` if the other replicas' (with their queued requests that go before this one: a
        higher class, or class ``priority`` and queued longer than ``waited_s``) fit under ``limit``:
        (claimed, theirs)."""
        ...

    async def restate(
        self,
        engine: str,
        held: dict[str, tuple[int, int]],
        mark: SampleMark | None,
        everything: bool = False,
        waiting: tuple[tuple[float, int, int], ...] = (),
        peak: tuple[int, int] | None = None,
        upto: int | None = None,
    ) -> int | None:
        """Set this replica's claims on ``engine``, (blocks, of which ``mark``'s sample shows) each (0 blocks
        removes one; ``everything``: unlisted ones up to ``upto`` go too), what the first requests of its queue
        have waited and need, and their class (``waiting``), and ``peak``: (restate number, the most its reservations
        up to ``upto``, the newest one it knew of, can hold at once)."""
        ...


@dataclass(slots=True)
class Admission:
    """A held reservation, plus what the response should say about the wait."""

    reservation: Reservation
    waited_s: float
    queue_position: int
    eta_s: float | None = None


def shed(retry_after_s: float, extra: dict[str, object]) -> GatewayError:
    return GatewayError(
        503,
        "The request was shed from the full admission queue for higher-priority traffic; retry later.",
        type="service_unavailable",
        code="shed",
        retry_after_s=retry_after_s,
        extra=extra,
    )


class Admitter:
    def __init__(
        self,
        controller: AdmissionController,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedBooks | None = None,
    ) -> None:
        self.controller = controller
        self.metrics = metrics
        self.clock = clock
        self.shared = shared  # other replicas' blocks per engine (Redis), when configured
        self._background: set[asyncio.Task[None]] = set()
        self._restating: set[str] = set()  # engines whose claims are being restated now
        self._restate_again: set[str] = set()  # engines asked to restate while one was on its way
        self._restates = itertools.count(1)  # numbers this replica's restates: a late one never undoes a newer
        self._waiters: dict[int, tuple[Ticket, asyncio.Future[Reservation], asyncio.TimerHandle]] = {}

    def prefix_of(self, request: InferenceRequest, cache: str = "") -> tuple[int, ...]:
        """The chunk hashes prefix affinity places ``request`` by; none for a pool of one (nothing to choose
        between) or with affinity off, so the sidecar layout pays nothing for it. ``cache``: the tenant whose
        prefix cache it can hit, when tenants' caches are kept apart (another's same prompt is no hit)."""
        config = self.controller.config.prefix_affinity
        if not config.enabled or len(self.controller.engines) < 2:
            return ()
        data = leading_bytes(request, config.chunk_bytes * config.max_chunks)
        return prefix_chain(data, config.chunk_bytes, config.max_chunks, seed=cache)

    async def acquire(
        self,
        cost: RequestCost,
        tenant: str,
        max_wait_s: float | None = None,
        qclass: QueueClass | None = None,
        body_bytes: int = 0,
        key: tuple[str, ...] = (),
        retry: bool = False,
        prefix: tuple[int, ...] = (),
    ) -> Admission:
        """Admit now, or wait in the queue until admitted (raises 429/503 when refused or out of time). With
        shared books, the admission also claims its blocks for the other replicas to see; a claim refused
        (they took the room meanwhile) gives the reservation back and queues again, ahead of first attempts.

        The caller owns the returned reservation and must :meth:`release` it."""
        started = self.clock()
        qclass = qclass or QueueClass()
        budget = self.controller.config.queue_max_wait_s if max_wait_s is None else max_wait_s
        while True:
            remaining = max(0.0, budget - (self.clock() - started))
            admission = await self._acquire_here(
                cost, tenant, remaining, qclass, body_bytes, key, retry, prefix, started
            )
            waited = self.clock() - started
            refused = None if self.shared is None else await self._claim(admission.reservation, waited, qclass)
            if refused is None:
                self.controller.placed(admission.reservation)
                return admission
            self.release(admission.reservation, refused)
            retry = True

    async def _claim(self, res: Reservation, waited_s: float, qclass: QueueClass) -> str | None:
        """Claim ``res``'s blocks in the shared books: None when claimed; else why not, as the release's
        outcome: ``claim_refused`` (the other replicas hold too much there now, or requests queued there for
        longer than ``waited_s`` need the room) or ``claim_unanswered`` (the books cannot say, and the
        request was placed on their earlier word). A cancellation meanwhile gives the reservation back (and
        the claim, if it was made)."""
        assert self.shared is not None
        book = self.controller.engines.get(res.engine)
        if book is None:
            return None
        try:
            now = self.clock()
            answer = await self.shared.claim(
                res.engine,
                str(res.id),
                res.blocks,
                book.room_for_others(now),
                book.shared_mark(now),
                waited_s,
                qclass.priority,
            )
        except BaseException:
            self.release(res, "client_disconnect")
            raise
        if answer is None:  # the shared books cannot say: this replica's own view decides, by the sample's
            trusted, book.others_blocks = book.others_blocks is not None, None
            return "claim_unanswered" if trusted else None  # placed on their earlier word: decide again
        claimed, others = answer
        book.others_blocks = others
        return None if claimed else "claim_refused"

    async def _acquire_here(
        self,
        cost: RequestCost,
        tenant: str,
        max_wait_s: float | None,
        qclass: QueueClass,
        body_bytes: int,
        key: tuple[str, ...],
        retry: bool,
        prefix: tuple[int, ...],
        arrived_at: float,
    ) -> Admission:
        """Admit now, or wait in the queue until admitted, by this replica's own books."""
        now = self.clock()
        decision = self.controller.submit(
            cost, tenant, now, max_wait_s, qclass, body_bytes, key, retry, prefix, arrived_at
        )
        if isinstance(decision, Admitted):
            self.metrics.admitted.inc()
            self._on_admitted(0.0, decision.reservation, qclass)
            return Admission(decision.reservation, 0.0, 0)
        if not isinstance(decision, Queued):
            eta = self.controller.eta(decision.position, now)
            extra: dict[str, object] = {
                "queue_depth": len(self.controller.queue),
                "queue_position": decision.position,
                "queue_eta_s": None if eta is None else round(eta, 3),
            }
            if decision.reason == "tenant_queue_full":
                raise GatewayError(
                    429,
                    f"Tenant '{tenant}' has reached its limit of queued requests; retry after the indicated time.",
                    type="rate_limit_exceeded",
                    code="tenant_queue_full",
                    retry_after_s=decision.retry_after_s,
                    extra=extra,
                )
            if decision.reason == "queue_wait_predicted":
                raise wait_predicted(decision.retry_after_s, extra)
            if decision.reason == "no_engine":
                raise upstream_unavailable(NO_ENGINE, decision.retry_after_s)
            raise queue_full(decision.retry_after_s, extra)
        ticket = decision.ticket
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Reservation] = loop.create_future()
        timer = loop.call_at(loop.time() + (ticket.deadline - now), self._expire, ticket.id)
        self._waiters[ticket.id] = (ticket, future, timer)
        self._shed(decision.shed, now)
        self.pump()  # it may be at the head already (a fairer tenant than the one that was waiting)
        try:
            reservation = await future
        except BaseException as exc:  # timed out, shed, refused as hopeless, or its client gone: it waited too
            self.metrics.queue_wait.observe(self.clock() - ticket.enqueued_at)
            if isinstance(exc, asyncio.CancelledError):
                self._abandon(ticket, future)
            raise
        waited = self.clock() - ticket.enqueued_at
        self._on_admitted(waited, reservation, qclass)
        return Admission(reservation, waited, decision.position, eta_s=decision.eta_s)

    def queued(self, tenant: str) -> int:
        """Requests of ``tenant`` waiting in the admission queue."""
        return self.controller.queue.tenant_len(tenant)

    def _shed(self, tickets: tuple[Ticket, ...], now: float) -> None:
        """Fail the requests a higher-class arrival pushed out of the full queue."""
        for ticket in tickets:
            _, future, timer = self._waiters.pop(ticket.id)
            timer.cancel()
            self.metrics.shed.labels(PRIORITIES[ticket.priority]).inc()
            if not future.done():
                position = len(self.controller.queue)
                eta = self.controller.eta(position, now)
                future.set_exception(
                    shed(
                        self.controller.retry_after(position, now),
                        {"queue_position": position, "queue_eta_s": None if eta is None else round(eta, 3)},
                    )
                )

    def _abandon(self, ticket: Ticket, future: asyncio.Future[Reservation]) -> None:
        """The waiting client went away: leave the queue, or give back a reservation granted meanwhile."""
        entry = self._waiters.pop(ticket.id, None)
        if entry is not None:
            entry[2].cancel()
        if (
            not self.controller.cancel(ticket)
            and future.done()
            and not future.cancelled()
            and future.exception() is None
        ):
            self.release(future.result(), "client_disconnect")
        self.pump()

    def _on_admitted(self, waited_s: float, reservation: Reservation, qclass: QueueClass) -> None:
        """The waiting request has its reservation (``admitted`` was counted when it was made)."""
        metrics = self.metrics
        metrics.projected_at_admission.observe(reservation.projected_usage)
        metrics.queue_wait.observe(waited_s)
        tokens = metrics.tenant_admitted_tokens.labels(reservation.tenant, PRIORITIES[qclass.priority])
        tokens.inc(reservation.cost.total_tokens)

    def events_are_tokens(self, engine: str) -> bool:
        """Whether a stream's event count from ``engine`` is its tokens (else a floor: speculative decoding)."""
        book = self.controller.engines.get(engine)
        return book is None or book.events_are_tokens

    def learn(
        self, reservation: Reservation, completion_tokens: int, *, ended: bool = True, whole: bool = False
    ) -> None:
        """A request completed with ``completion_tokens`` (or was stopped after them: ``ended=False``): the
        output-length estimate learns it, and, for an answer sent whole (``whole``), the pace of answers how
        long it took."""
        self.controller.learn(reservation, completion_tokens, ended=ended, now=self.clock() if whole else None)

    def answer_s(self, cost: RequestCost, key: tuple[str, ...]) -> float:
        """Seconds a request like this is expected to take from admission to its answer's end (0: unknown)."""
        return self.controller.answer_s(cost, key)

    def certain_answer_s(self, cost: RequestCost) -> float:
        """Seconds an answer of certain length takes once admitted (0: its length or such a pace unknown)."""
        return self.controller.certain_answer_s(cost)

    def first_event_s(self) -> float:
        """Seconds a stream is expected to wait, once admitted, for its first event (0: unknown)."""
        return self.controller.first_event.seconds()

    def tokens_by_now(self, reservation: Reservation) -> int | None:
        """Output tokens an answer admitted as ``reservation`` has had time to produce, at the latest answers'
        pace (their fastest quarter: more, not fewer); None while the pace is unknown."""
        pace = self.controller.pace.seconds_per_token()
        if pace is None or pace <= 0:
            return None
        return math.ceil((self.clock() - reservation.admitted_at) / pace)

    def release(self, reservation: Reservation, outcome: str) -> bool:
        """Give the reservation's blocks back and admit whoever now fits; True the first time only."""
        finished = outcome not in NOT_FINISHED
        if not self.controller.release(reservation, self.clock(), finished=finished):
            return False
        self.metrics.released.labels(outcome).inc()
        if self.shared is not None:
            self._spawn(self._restate(reservation.engine, {str(reservation.id): (0, 0)}))
        self.pump()
        return True

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _restate(self, engine: str, held: dict[str, tuple[int, int]], everything: bool = False) -> None:
        assert self.shared is not None
        book = self.controller.engines.get(engine)
        now = self.clock()
        mark = None if book is None else book.shared_mark(now)
        # The queue's head is held for on the engines it may go to, not on one it cannot be placed on (ejected,
        # leaving, or without fresh metrics); a closed gate closes for every replica alike, and opens for the
        # replica that scrapes first: the head is held for there too.
        placeable = book is not None and book.placeable and not book.is_stale(now)
        within = None if book is None or book.geometry is None else book.geometry.num_blocks
        waiting = self.controller.queued_first(now, within=within) if placeable else ()
        # Taken in the same step as ``held``: a reservation made after it has a newer id than ``upto``.
        peak = None if book is None else (next(self._restates), book.shared_peak())
        upto = None if book is None else book.ledger.last_id
        others = await self.shared.restate(engine, held, mark, everything, waiting, peak, upto)
        if book is not None:
            before, book.others_blocks = book.others_blocks, others
            if others is not None and (before is None or others < before):
                self.pump()  # the other replicas freed room: the queue here hears of it now, not a sample later

    def _restate_later(self, engine: str) -> None:
        """Restate everything on ``engine`` soon: one restate at a time per engine, and one more after it if
        asked meanwhile (the one on its way was taken before what asked)."""
        if self.shared is None:
            return
        if engine in self._restating:
            self._restate_again.add(engine)
            return
        self._restating.add(engine)
        self._spawn(self._restate_all(engine))

    async def _restate_all(self, engine: str) -> None:
        """After a sample: this replica's claims on ``engine`` now (what the sample shows taken off)."""
        try:
            book = self.controller.engines.get(engine)
            if book is not None:
                await self._restate(engine, book.claims(), everything=True)
        finally:
            self._restating.discard(engine)
            if engine in self._restate_again:
                self._restate_again.discard(engine)
                self._restate_later(engine)

    def progress(self, reservation: Reservation, generated: int, lead_tokens: int = 0) -> None:
        cost = reservation.cost
        first = reservation.first_token_at is None
        self.controller.progress(reservation, generated, self.clock(), lead_tokens)
        if reservation.cost is not cost:  # it outran its estimate: the other replicas must hear of it now
            self._restate_later(reservation.engine)
        if first and self._waiters and self.controller.config.growth_model == "lockstep":
            self.pump()  # no longer counted whole: the lockstep peak fell, and the head may fit

    def pump(self) -> None:
        """Wake every queued request that fits now; when no engine is left to take any (the pool emptied),
        answer every queued one at once rather than at the end of its budget."""
        if self._waiters and (back_in := self.controller.no_engine_for(self.clock())) is not None:
            self.fail_all_queued(lambda _: upstream_unavailable(NO_ENGINE, back_in))
            return
        for ticket, reservation in self.controller.pump(self.clock()):
            _, future, timer = self._waiters.pop(ticket.id)
            timer.cancel()
            # counted now, not when the waiter wakes: it may be cancelled in between, and its release counts
            self.metrics.admitted.inc()
            if future.done():  # cancelled while we were deciding: give the blocks straight back
                self.release(reservation, "client_disconnect")
            else:
                future.set_result(reservation)

    def _expire(self, ticket_id: int | None = None) -> None:
        """Answer every queued request whose deadline has passed; ``ticket_id``'s timer fired. A timer may
        fire before its deadline (uvloop rounds delays to whole milliseconds): a ticket not due yet gets a
        timer again, or it would wait past its budget with none left."""
        now = self.clock()
        waiting = self._waiters.get(ticket_id) if ticket_id is not None else None
        if waiting is not None and waiting[0].deadline > now:
            ticket, future, _ = waiting
            loop = asyncio.get_running_loop()
            timer = loop.call_at(loop.time() + max(0.001, ticket.deadline - now), self._expire, ticket.id)
            self._waiters[ticket.id] = (ticket, future, timer)
        expired = self.controller.expire(now)
        for ticket in expired:
            _, future, _ = self._waiters.pop(ticket.id)
            if not future.done():
                position = 1 + len(self.controller.queue)
                eta = self.controller.eta(position, now)
                future.set_exception(
                    queue_timeout(
                        self.controller.retry_after(position, now),
                        now - ticket.enqueued_at,
                        {
                            "queue_position": position,
                            "queue_eta_s": None if eta is None else round(eta, 3),
                            "estimated_wait_s": _rounded(ticket.eta_s),
                        },
                    )
                )
        if expired and self._waiters:  # a head that did not fit is gone: those behind it may
            self.pump()

    # --- the scrapers' subscriber (one feed per engine) ---------------------------------------------------

    def feed(self, engine: str) -> EngineFeed:
        """What ``engine``'s scraper publishes to."""
        return EngineFeed(self, engine)

    def scrape_started(self, engine: str = DEFAULT_ENGINE) -> None:
        self.controller.begin_sample(engine)

    def sample(self, sample: UsageSample, engine: str = DEFAULT_ENGINE) -> None:
        verdict = self.controller.apply_sample(sample, engine)
        if verdict.lost:  # the engine restarted: these died with it (their streams end in errors)
            self.metrics.released.labels("engine_restart").inc(len(verdict.lost))
        self._restate_later(engine)
        self.pump()
        self._refuse_hopeless()

    def scrape_failed(self, engine: str = DEFAULT_ENGINE, refused: bool = False) -> None:
        self.controller.scrape_failed(self.clock(), engine, refused)
        self._restate_later(engine)  # the claims' leases must outlive an outage of the engine's metrics
        self.pump()  # the stale policy may admit (or keep holding) by its own rules

    def busy(self, engine: str) -> None:
        """``engine`` turned a request away, its queue full: hold admissions there until it has room."""
        self.controller.hold_busy(engine, self.clock())

    def unreachable(self, engine: str) -> bool:
        """A request placed on ``engine`` could not connect: eject it (in a pool). True if ejected."""
        return self.controller.eject(engine, self.clock()) is not None

    def _refuse_hopeless(self) -> None:
        """Queued requests that can no longer be admitted within their budget hear so now."""
        now = self.clock()
        for ticket, predicted, retry_after in self.controller.hopeless(now):
            _, future, timer = self._waiters.pop(ticket.id)
            timer.cancel()
            if not future.done():
                extra: dict[str, object] = {
                    "queue_eta_s": round(predicted, 3),
                    "waited_s": round(now - ticket.enqueued_at, 3),
                    "estimated_wait_s": _rounded(ticket.eta_s),  # what it was told to expect on arrival
                }
                future.set_exception(wait_predicted(retry_after, extra))
        self.pump()  # a refused ticket at the head may have held back one that fits

    def fail_all_queued(self, error: Callable[[float], GatewayError]) -> None:
        """Answer every queued request with ``error`` (shutdown), to come back in a second (to another replica,
        as new requests and those waiting for a tenant slot are told)."""
        for ticket_id in list(self._waiters):
            ticket, future, timer = self._waiters.pop(ticket_id)
            timer.cancel()
            self.controller.cancel(ticket)
            if not future.done():
                future.set_exception(error(1.0))


@dataclass(frozen=True, slots=True)
class EngineFeed:
    """One engine's scraper publishes here; the admitter hears which engine spoke."""

    admitter: Admitter
    engine: str

    def scrape_started(self) -> None:
        self.admitter.scrape_started(self.engine)

    def sample(self, sample: UsageSample) -> None:
        self.admitter.sample(sample, self.engine)

    def scrape_failed(self, refused: bool = False) -> None:
        self.admitter.scrape_failed(self.engine, refused)


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)
