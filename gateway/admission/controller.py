"""Admission: admit, queue or reject a request by its KV-block cost, and place it on an engine of the pool.
Pure: time comes in as ``now``.

Each engine keeps its own books (:mod:`gateway.admission.engine`: gate, ledger, geometry, last sample). A
request is placed on the engine where it fits with the most headroom left after it (projected usage, not the
last sample); there is one queue for the whole pool (priority classes and tenant fairness as in
:mod:`gateway.admission.queue`), served the moment any engine has room. A pool of one engine is the sidecar
layout, and the convenience properties ``ledger``, ``gate`` and ``sample`` read its books.

What is learned is the pool's: output lengths (the same model behind every engine), the finish rate that
queue ETAs and Retry-After come from, and how cautious the estimate is. A queued request leaves by its
deadline, so nothing waits forever.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

from gateway.admission.affinity import PrefixMap
from gateway.admission.engine import EngineBook, SampleVerdict, UsageSample
from gateway.admission.gate import HysteresisGate
from gateway.admission.ledger import ENGINE_LEAD_TOKENS, Ledger, Reservation
from gateway.admission.output_lengths import BEYOND, OutputLengths
from gateway.admission.queue import AdmissionQueue, QueueClass, Refused, Ticket
from gateway.admission.service_time import FirstEventWait, ServicePace
from gateway.config import AdmissionConfig
from gateway.tokens.cost import KvGeometry, RequestCost

__all__ = ["AdmissionController", "Admitted", "Decision", "Queued", "Rejected", "UsageSample"]

DEFAULT_ENGINE = ""  # the one engine of a pool of one
QUEUE_SHOWN = 16  # queued requests a replica shows the others (they let them go before younger ones)


@dataclass(frozen=True, slots=True)
class Admitted:
    reservation: Reservation


@dataclass(frozen=True, slots=True)
class Queued:
    """Waiting: ``position`` and ``eta_s`` as estimated on arrival; ``shed`` are tickets it pushed out."""

    ticket: Ticket
    position: int = 1
    eta_s: float | None = None
    shed: tuple[Ticket, ...] = ()


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: Literal["queue_full", "tenant_queue_full", "no_capacity_info", "queue_wait_predicted", "no_engine"]
    retry_after_s: float
    position: int = 0


Decision = Admitted | Queued | Rejected


RATE_SPAN_FLOOR_S = 0.25  # about a scrape's time (telemetry.scrape_interval_s's default)


class DrainRate:
    """Requests finished per second over a sliding window: the basis of Retry-After and queue ETAs."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._events: deque[float] = deque()

    def record(self, now: float) -> None:
        self._events.append(now)
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0] < now - self.window_s:
            self._events.popleft()

    MATURE_EVENTS = 8  # finished requests in the window before a rate is trusted to refuse anybody

    def mature(self, now: float) -> bool:
        self._trim(now)
        return len(self._events) >= self.MATURE_EVENTS

    def per_second(self, now: float) -> float:
        self._trim(now)
        if len(self._events) < 2:
            return 0.0
        # a burst of finishes in one instant is not a rate: over a scrape's time at least (32 within a millisecond
        # read 32,000/s, and every queue ETA 0); no longer, or the first burst after a lull reads slow, and
        # requests that would be served are refused as hopeless
        span = max(now - self._events[0], RATE_SPAN_FLOOR_S)
        return len(self._events) / span


# The longest Retry-After the OpenAI SDKs wait for: openai-python 2.x and later do not retry past it (1.x
# retries on its own backoff past 60 s). A longer one is still told, but no return is booked for it.
HONOURED_RETRY_AFTER_S = 120.0


class ReturnBook:
    """When refused clients were told to come back: the Retry-After of a refusal books the next free return
    slot, no earlier than the line it was refused from is gone and one finish after the last booked return, so
    the clients told to come back do not all come back at once. A retry queues ahead of its own tenant's first
    attempts (see :mod:`gateway.admission.queue`), so a first attempt counts the returns of its tenant due while
    it would wait as ahead of it (another tenant's retry goes ahead of that tenant's own). A return is
    forgotten ``grace_s`` after its time: the client came back, or gave up."""

    def __init__(self, grace_s: float = 2.0, max_booked: int = 100_000) -> None:
        self.grace_s = grace_s
        self.max_booked = max_booked
        self._times: list[float] = []  # nondecreasing: each booking is after the previous one
        self._by_tenant: dict[str, list[float]] = {}  # the same bookings, per tenant (nondecreasing each)

    def __len__(self) -> int:
        return len(self._times)

    def book(self, earliest: float, spacing_s: float, latest: float = math.inf, tenant: str = "") -> float:
        """Book ``tenant``'s return at ``earliest`` or ``spacing_s`` after the last booked one (anyone's: they
        share the engine), whichever is later; one past ``latest`` is only told, not booked: the client will
        not wait that long."""
        at = max(earliest, self._times[-1] + spacing_s) if self._times else earliest
        if at <= latest and len(self._times) < self.max_booked:
            self._times.append(at)
            self._by_tenant.setdefault(tenant, []).append(at)
        return at

    def due(self, start: float, end: float, tenant: str | None = None) -> int:
        """Returns booked in ``[start - grace_s, end]``: expected back before ``end``, or late but still coming;
        ``tenant``'s alone when given."""
        times = self._times if tenant is None else self._by_tenant.get(tenant, [])
        return bisect.bisect_right(times, end) - bisect.bisect_left(times, start - self.grace_s)

    def forget(self, now: float) -> None:
        gone = bisect.bisect_left(self._times, now - self.grace_s)
        if gone:
            del self._times[:gone]
            for tenant, times in list(self._by_tenant.items()):
                if cut := bisect.bisect_left(times, now - self.grace_s):
                    del times[:cut]
                if not times:
                    del self._by_tenant[tenant]


class Caution:
    """How much of the output distribution is reserved: the configured quantile while the engine stays healthy,
    one step more cautious (towards the whole budget) each time it preempts or runs past the high watermark,
    one step back after ``relax_after_s`` of calm. Steps: q, then halving what is left out (0.9 -> 0.95 ->
    0.975 -> ...), then 1.0 (reserve the whole budget)."""

    MAX_LEVEL = 4

    def __init__(self, base: float, relax_after_s: float) -> None:
        self.base = base
        self.relax_after_s = relax_after_s
        self.level = 0
        self._calm_since: float | None = None
        self._raised_at: float | None = None

    @property
    def quantile(self) -> float:
        if self.level >= self.MAX_LEVEL or self.base >= 1:
            return 1.0
        return 1 - (1 - self.base) / 2.0**self.level

    def observe(self, now: float, trouble: bool) -> None:
        """One sample's verdict. One episode of trouble spans many samples: it raises the level once per
        ``relax_after_s / 6`` at most, so a burst of preemptions steps it up, not straight to the top."""
        if trouble:
            if self._raised_at is None or now - self._raised_at >= self.relax_after_s / 6:
                self.level = min(self.MAX_LEVEL, self.level + 1)
                self._raised_at = now
            self._calm_since = now
        elif self.level > 0:
            if self._calm_since is None:
                self._calm_since = now
            elif now - self._calm_since >= self.relax_after_s:
                self.level -= 1
                self._calm_since = now


def teaches(res: Reservation) -> bool:
    """Whether where this request stops says anything about where outputs stop on their own: not a batch or
    n > 1 (the mean hides the longest sequence), not one told to run to its budget (ignore_eos)."""
    full = res.full
    return full.max_output > 0 and full.num_sequences == 1 and full.min_output < full.max_output


class AdmissionController:
    def __init__(
        self,
        config: AdmissionConfig,
        geometry: KvGeometry | None = None,
        engines: tuple[str, ...] = (DEFAULT_ENGINE,),
        shared_books: bool = False,
    ) -> None:
        """``shared_books``: other gateway replicas admit to these engines too, and say what they hold through
        shared books (the admitter's); until they do, no engine's ledger is taken as a bound."""
        self.config = config
        self.shared_books = shared_books
        self.queue = AdmissionQueue(config.queue_max_length, config.queue_max_bytes)
        self.geometry_override = geometry  # the operator's: every engine is taken to have this pool
        self.engines: dict[str, EngineBook] = {}
        self._geometry: KvGeometry | None = None  # the pool's, worked out when the pool changes (read per request)
        for name in engines:
            self.add_engine(name)
        self.drain = DrainRate()
        est = config.output_estimate
        self.lengths = OutputLengths(window=est.window, min_samples=est.min_samples)
        self.pace = ServicePace()  # seconds per output token, admission to answer: how long an answer takes
        self.first_event = FirstEventWait()  # admission to a stream's first event: what its head waits for
        self.caution = Caution(est.quantile, est.relax_after_s)
        self.outran = 0  # requests that outran their estimate (and grew their reservation)
        self.returns = ReturnBook()
        self.affinity = PrefixMap(config.prefix_affinity.max_entries)
        self.affinity_placements = 0  # placed on the engine that took its prefix, over the most headroom

    # --- the pool -----------------------------------------------------------------------------------

    def add_engine(self, name: str) -> EngineBook:
        """An engine joins (or one that was leaving comes back)."""
        book = self.engines.get(name)
        if book is None:
            book = self.engines[name] = EngineBook(name, self.config, self.geometry_override, self.shared_books)
        book.leaving = False
        self._pool_changed()
        return book

    def remove_engine(self, name: str) -> None:
        """An engine left the pool: nothing new goes there, its books go once its requests have ended."""
        book = self.engines.get(name)
        if book is not None:
            book.leaving = True
            self._forget_if_done(book)
            self._pool_changed()

    def _forget_if_done(self, book: EngineBook) -> None:
        if book.leaving and len(book.ledger) == 0:
            del self.engines[book.name]
            self._pool_changed()  # the pool's block size may have been the one that left

    @property
    def only(self) -> EngineBook:
        """The engine of a pool of one (the sidecar layout)."""
        if len(self.engines) != 1:
            raise LookupError(f"a pool of {len(self.engines)} engines has no single engine")
        return next(iter(self.engines.values()))

    @property
    def ledger(self) -> Ledger:
        return self.only.ledger

    @property
    def gate(self) -> HysteresisGate:
        return self.only.gate

    @property
    def sample(self) -> UsageSample | None:
        return self.only.sample

    @property
    def geometry(self) -> KvGeometry | None:
        """What a request is priced against: the pool's block size and the largest pool of the engines with
        blocks of that size (a request that fits none of them never fits). The pool's block size is the one
        with the most KV capacity among the engines that stay (a leaving engine still draining streams does
        not hold the rest back); engines with blocks of another size take nothing. Read several times per
        request, worked out only when an engine comes, goes or is sampled (:meth:`_pool_changed`)."""
        return self._geometry

    def _pool_geometry(self) -> KvGeometry | None:
        """The block size most of the pool's tokens are in, from the engines that take requests: not one that
        is leaving, nor one ejected (dead, or restarting with another ``--block-size``: the rest would all be
        of the "other" size and nothing placeable); failing those, from any. Its blocks are the largest
        engine's of that size that stays, ejected or not: a request only it can hold waits for it to be back,
        rather than being refused as larger than any engine (a 400 no retry helps) for its backoff."""
        books = [(b, b.geometry) for b in self.engines.values() if b.geometry is not None]
        staying = [g for b, g in books if not b.leaving]
        known = [g for b, g in books if not b.leaving and not b.ejected] or staying or [g for _, g in books]
        if not known:
            return None
        totals: dict[int, int] = {}
        for geometry in known:
            totals[geometry.block_size] = totals.get(geometry.block_size, 0) + geometry.num_blocks * geometry.block_size
        block_size = max(totals, key=lambda size: (totals[size], -size))
        return max((g for g in staying or known if g.block_size == block_size), key=lambda g: g.num_blocks)

    def _pool_changed(self) -> None:
        """Work out the pool's geometry again, and keep out of placement the engines whose blocks are not the
        pool's size: a request's blocks, priced in the pool's, would be half (or twice) what it holds there,
        and that engine would preempt (or idle)."""
        self._geometry = pool = self._pool_geometry()
        for book in self.engines.values():
            book.other_block_size = (
                pool is not None and book.geometry is not None and book.geometry.block_size != pool.block_size
            )

    def in_flight(self) -> int:
        return sum(len(b.ledger) for b in self.engines.values())

    # --- telemetry in -------------------------------------------------------------------------------

    def begin_sample(self, engine: str = DEFAULT_ENGINE) -> None:
        book = self.engines.get(engine)
        if book is not None:
            book.begin_sample()

    def apply_sample(self, sample: UsageSample, engine: str = DEFAULT_ENGINE) -> SampleVerdict:
        book = self.engines.get(engine)
        if book is None:
            return SampleVerdict(False)
        verdict = book.apply_sample(sample)
        self.caution.observe(sample.taken_at, verdict.trouble)
        self._forget_if_done(book)
        self._pool_changed()
        self.lengths.set_in_flight(
            (res.key, res.generated)
            for b in self.engines.values()
            for res in b.ledger.live()
            if res.first_token_at is not None and teaches(res)
        )
        return verdict

    def scrape_failed(self, now: float, engine: str = DEFAULT_ENGINE, refused: bool = False) -> bool:
        """True if the failure ejected the engine (only in a pool: a lone engine keeps the stale policy).
        ``refused``: its connection was refused (see :attr:`EngineBook.down`)."""
        book = self.engines.get(engine)
        ejected = book is not None and book.scrape_failed(now, pooled=len(self.engines) > 1, refused=refused)
        if ejected:
            self._pool_changed()
        return ejected

    def eject(self, engine: str, now: float) -> float | None:
        """The engine refused a connection: place nothing there for a while (only in a pool). The backoff."""
        book = self.engines.get(engine)
        if book is None or len(self.engines) < 2:
            return None
        if book.ejected:  # the other requests that were on their way there: one ejection, not one each
            return book.ejected_until - now if book.ejected_until is not None else None
        backoff = book.eject(now, "connect")
        self._pool_changed()
        return backoff

    def is_stale(self, now: float) -> bool:
        """No engine has a fresh picture."""
        return all(b.is_stale(now) for b in self.engines.values())

    # --- the decision -------------------------------------------------------------------------------

    def place(self, blocks: int, now: float, prefix: tuple[int, ...] = ()) -> tuple[EngineBook, float, bool] | None:
        """The engine where ``blocks`` more fit with the most headroom left after them, its projected usage
        then, and whether prefix affinity chose it; None when no engine has room. A stale engine is chosen
        only when no fresh one fits.

        With a ``prefix`` (its prompt's chunk hashes), the engine that took the longest known part of it is
        preferred while its usage after would be at most ``prefix_affinity.max_headroom_cost`` above the
        best's (and as fresh): its prefix cache holds those blocks."""
        home = self._affine_engine(prefix)
        best: tuple[bool, float, EngineBook] | None = None
        affine: tuple[bool, float, EngineBook] | None = None
        for book in self.engines.values():
            if not book.placeable:
                continue
            usage = book.fits(blocks, now)
            if usage is None:
                continue
            candidate = (book.is_stale(now), usage, book)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
            if book.name == home:
                affine = candidate
        if best is None:
            return None
        cost = self.config.prefix_affinity.max_headroom_cost
        if affine is not None and affine[2] is not best[2] and affine[0] <= best[0] and affine[1] <= best[1] + cost:
            return affine[2], affine[1], True
        return best[2], best[1], False

    def no_engine_for(self, now: float) -> float | None:
        """Seconds until an engine of the pool may take requests again (the end of the first ejection's
        backoff, at least 1), when none is taking any: each is down (ejected, and refusing connections) or
        leaving. None while one is not (or in a pool of one, which is never ejected): an engine ejected for
        metrics that time out under load may still be serving, and requests wait for it as for room. With no
        engine at all, or each leaving (discovery finds none: a scale to zero, the last pod of a rollout
        going), 1, whatever the pool's size."""
        books = self.engines.values()
        if all(b.leaving for b in books):
            return 1.0
        if len(self.engines) < 2 or any(not (b.ejected and b.down) and not b.leaving for b in books):
            return None
        returns = [b.ejected_until for b in books if b.ejected_until is not None and not b.leaving]
        return max(1.0, min(returns, default=now + 1.0) - now)

    def _first_with_an_engine(self) -> Ticket | None:
        """When the head of the queue is larger than every placeable engine's whole pool: the first ticket in
        serving order that is not (None if none is, or if the head is not: then it waits for room)."""
        largest = max((b.geometry.num_blocks for b in self.engines.values() if b.placeable and b.geometry), default=0)
        head = self.queue.peek()
        if head is None or head.cost.blocks <= largest:
            return None
        return next((t for t in self.queue.in_order() if t.cost.blocks <= largest), None)

    def _affine_engine(self, prefix: tuple[int, ...]) -> str | None:
        """The engine that took the longest known part of ``prefix``; None without one, or in a pool of one."""
        if not prefix or len(self.engines) < 2:
            return None
        hit = self.affinity.lookup(prefix)
        return None if hit is None else hit[0]

    def projected_blocks(self, extra_blocks: int, now: float) -> int | None:
        """Of a pool of one: the blocks its engine may hold with ``extra_blocks`` more."""
        return self.only.projected_blocks(extra_blocks, now)

    def _reserve(
        self,
        book: EngineBook,
        cost: RequestCost,
        full: RequestCost,
        key: tuple[str, ...],
        tenant: str,
        now: float,
        projected_usage: float,
        prefix: tuple[int, ...] = (),
        by_affinity: bool = False,
    ) -> Reservation:
        res = book.ledger.reserve(cost, tenant, now, full, key)
        res.engine = book.name
        res.prefix = prefix
        res.by_affinity = by_affinity
        res.projected_usage = projected_usage  # what the decision saw, for the metrics
        return res

    def placed(self, res: Reservation) -> None:
        """The admission took effect (with shared books: its claim was granted): count the placement and teach
        prefix affinity where the prefix went. Here, not at the decision, so that a claim refused and placed
        again is one placement (the counters never go back) and the prefix map names the engine that ran it."""
        book = self.engines.get(res.engine)
        if book is None:
            return  # the engine left the pool meanwhile
        book.placements += 1
        if res.by_affinity:
            self.affinity_placements += 1
        if res.prefix:
            self.affinity.record(res.prefix, book.name)

    # --- requests -----------------------------------------------------------------------------------

    def submit(
        self,
        cost: RequestCost,
        tenant: str,
        now: float,
        max_wait_s: float | None = None,
        qclass: QueueClass | None = None,
        body_bytes: int = 0,
        key: tuple[str, ...] = (),
        retry: bool = False,
        prefix: tuple[int, ...] = (),
        arrived_at: float | None = None,
    ) -> Decision:
        """Admit now if nothing of this class or a higher one waits and it fits; otherwise queue (possibly
        shedding a lower-class ticket), or reject when the queue (or the tenant's share of it) is full. A
        ``retry`` (the client came back after a refusal) queues ahead of its tenant's first attempts;
        ``arrived_at``: when a request queued again here first arrived.

        A queued ticket may be at the head already: the caller pumps right after."""
        qclass = qclass or QueueClass()
        expected = self.expected_cost(cost, key)
        if not self.queue.waiting_at_or_above(qclass.priority) and (placed := self.place(expected.blocks, now, prefix)):
            book, usage, by_affinity = placed
            return Admitted(self._reserve(book, expected, cost, key, tenant, now, usage, prefix, by_affinity))
        if (back_in := self.no_engine_for(now)) is not None:
            # every engine is down (or leaving): a prompt 503 to come back, not a wait of the whole budget
            return Rejected("no_engine", back_in, len(self.queue) + 1)
        wait = self.config.queue_max_wait_s if max_wait_s is None else max_wait_s
        ahead = self.queue.prospective_position(tenant, qclass.priority, retry)
        predicted = self.predicted_wait(ahead, now)
        if predicted is not None and not retry:  # its tenant's clients told to come back meanwhile go ahead of it
            ahead += self.returns.due(now, now + predicted, tenant)
            predicted = self.predicted_wait(ahead, now)
        if predicted is not None and predicted > wait:
            # it would wait its whole budget and then be refused: refuse now, and book when to come back
            return Rejected("queue_wait_predicted", self.book_return(now, predicted, tenant), ahead)
        ticket = Ticket(
            expected,
            tenant,
            enqueued_at=now,
            deadline=now + wait,
            qclass=qclass,
            body_bytes=body_bytes,
            full=cost,
            key=key,
            retry=retry,
            prefix=prefix,
            arrived_at=arrived_at,
        )
        pushed = self.queue.push(ticket)
        if isinstance(pushed, Refused):
            position = len(self.queue) + 1
            return Rejected(pushed.reason, self.retry_after(position, now), position)
        position = self.queue.position(ticket)
        ticket.eta_s = self.eta(position, now)
        return Queued(ticket, position, ticket.eta_s, pushed.shed)

    def pump(self, now: float) -> list[tuple[Ticket, Reservation]]:
        """Admit from the head of the queue (highest class, fairest tenant) while the head fits. A head too
        large for every engine placeable now waits for an engine, not for room (the one large enough was
        ejected, or is leaving): the first one behind it that could fit goes in its stead, so one request
        does not hold up the whole pool until that engine is back."""
        admitted = []
        while (head := self.queue.peek()) is not None:
            placed = self.place(head.cost.blocks, now, head.prefix)
            if placed is None:
                head = self._first_with_an_engine()
                if head is None or (placed := self.place(head.cost.blocks, now, head.prefix)) is None:
                    break
                self.queue.serve(head)
            else:
                self.queue.pop()
            book, usage, by_affinity = placed
            full = head.full or head.cost
            res = self._reserve(book, head.cost, full, head.key, head.tenant, now, usage, head.prefix, by_affinity)
            admitted.append((head, res))
        return admitted

    def queued_first(
        self, now: float, count: int = QUEUE_SHOWN, within: int | None = None
    ) -> tuple[tuple[float, int, int], ...]:
        """The first ``count`` requests of the queue, in the order they would be admitted: (seconds each has
        waited since it first arrived, its blocks, its class). Other gateway replicas let them go before
        their requests of a lower class and their younger ones of the same class; more than the head, or a
        replica admitting a burst into freed room would take all of it but the head's share. ``within``: the
        blocks of the engine they are shown for; a request larger than its whole pool waits for another engine,
        not for room there, and is left out."""
        shown = self.queue.in_order(first=count)
        if within is not None and any(t.cost.blocks > within for t in shown):
            shown = [t for t in self.queue.in_order() if t.cost.blocks <= within][:count]
        return tuple(
            (now - (t.enqueued_at if t.arrived_at is None else t.arrived_at), t.cost.blocks, t.priority) for t in shown
        )

    def expire(self, now: float) -> list[Ticket]:
        return self.queue.expired(now)

    def cancel(self, ticket: Ticket) -> bool:
        return self.queue.remove(ticket)

    def progress(self, res: Reservation, generated: int, now: float, lead_tokens: int = 0) -> None:
        """``generated``: output tokens seen (over all sequences, at least); ``lead_tokens``: how much further
        per sequence the engine may be than that, beyond ``ENGINE_LEAD_TOKENS`` (a batched stream)."""
        book = self.engines.get(res.engine)
        if book is None or res.released:
            return
        if res.first_token_at is None:
            self.first_event.observe(now - res.admitted_at)
        book.ledger.progress(res, generated, now, lead_tokens)
        expected, full = res.cost.max_output, res.full.max_output
        if expected >= full:
            return  # holds its whole budget already (a batch always does: see expected_cost)
        seen = res.generated // max(1, res.cost.num_sequences)  # one sequence: no batch's share to work out
        if seen + ENGINE_LEAD_TOKENS + res.lead_tokens >= expected and book.geometry is not None:
            # it outran its estimate: expect what the requests that went this far went on to, or its budget
            longer = self.lengths.quantile(res.key, self.caution.quantile, above=seen)
            cap = full if longer is None else max(longer, seen + res.lead_tokens + 2 * ENGINE_LEAD_TOKENS)
            book.ledger.resize(res, res.full.capped(cap, book.geometry.block_size))
            if not res.outran:
                res.outran = True
                self.outran += 1

    # --- learning what requests really use ----------------------------------------------------------

    def expected_cost(self, cost: RequestCost, key: tuple[str, ...]) -> RequestCost:
        """What the request will most likely hold: its prompt plus the learned output quantile, never more
        than its budget; the whole budget while nothing is known or the engine has shown it is too tight."""
        q = self.caution.quantile
        if not self.config.output_estimate.enabled or cost.max_output == 0 or q >= 1 or self.geometry is None:
            return cost
        if cost.num_sequences > 1:  # n > 1 or a batch: the longest sequence is what fills the pool
            return cost
        expected = self.lengths.quantile(key, q) or self.config.output_estimate.prior_tokens
        if expected is None:
            return cost
        expected = max(expected, cost.min_output, 1)  # min_tokens: it will produce at least that many
        if expected >= cost.max_output:
            return cost
        return cost.capped(expected, self.geometry.block_size)

    def learn(self, res: Reservation, completion_tokens: int, *, ended: bool = True, now: float | None = None) -> None:
        """A request finished after producing ``completion_tokens`` (over all its sequences); ``ended=False``:
        it was stopped before it ended (its client went away). One that ran into its own budget was stopped as
        well: both are learned as longer than what they produced, not as lengths (a completion's default of 16
        would teach every chat that outputs are 16 tokens long, and a tenant's cap that outputs end under it). A
        batch, whose mean hides its longest sequence, is not learned. ``now``: when its answer, sent whole (not
        streamed), ended, which teaches the pace answers come at (:meth:`answer_s`)."""
        if ended and now is not None and res.full.num_sequences == 1:  # n > 1 decodes its sequences side by side
            self.pace.observe(completion_tokens, now - res.admitted_at)
        if not teaches(res):
            return
        ended = ended and completion_tokens < res.full.max_output
        if ended or completion_tokens > 0:
            self.lengths.observe(res.key, min(completion_tokens, res.full.max_output), ended=ended)

    def answer_s(self, cost: RequestCost, key: tuple[str, ...]) -> float:
        """Seconds a request like this one is expected to take once admitted, to its answer's end: its output
        (its budget, if it runs to it, as with ignore_eos; else the median output length of its key, never
        past its budget nor short of its floor) at the latest answers' pace; 0 while either is unknown. When
        the median lies past anything seen to end (most of its key's requests were stopped, by their
        ``max_tokens`` as a rule, or are still running), the median of what they had produced stands in: short
        of their median, never past it (see :mod:`gateway.admission.service_time`)."""
        if cost.num_sequences > 1 or cost.max_output == 0:
            return 0.0
        if cost.min_output >= cost.max_output:
            return self.pace.answer_s(cost.max_output)
        median = self.lengths.quantile(key, 0.5)
        if median == BEYOND:
            median = self.lengths.at_least(key, 0.5)
        if median is None:
            return 0.0
        return self.pace.answer_s(min(cost.max_output, max(cost.min_output, median)))

    def certain_answer_s(self, cost: RequestCost) -> float:
        """Seconds an answer of certain length (it runs to its budget: ``ignore_eos``, ``min_tokens``) takes
        at the pace of answers about as long; 0 when its length is not certain or no such pace is known."""
        if cost.num_sequences > 1 or not 0 < cost.max_output <= cost.min_output:
            return 0.0
        return self.pace.answer_s_like(cost.max_output)

    def release(self, res: Reservation, now: float, finished: bool = True) -> bool:
        """Give ``res`` back (True the first time only). ``finished``: the request ended on the engine, which
        is what the finish rate behind queue ETAs counts (not a claim refused or an engine unreachable)."""
        book = self.engines.get(res.engine)
        if book is None or not book.ledger.release(res):
            return False
        if finished:
            self.drain.record(now)
        self._forget_if_done(book)
        return True

    def hold_busy(self, engine: str, now: float) -> None:
        """``engine`` turned a request away as busy: see :meth:`EngineBook.hold_busy`."""
        book = self.engines.get(engine)
        if book is not None:
            book.hold_busy(now)

    # --- telling clients when to come back ----------------------------------------------------------

    def predicted_wait(self, position: int, now: float) -> float | None:
        """The wait of the request at ``position``, once the finish rate is known well enough to act on."""
        return self.eta(position, now) if self.drain.mature(now) else None

    def hopeless(self, now: float) -> list[tuple[Ticket, float, float]]:
        """Queued tickets whose predicted wait now runs past their deadline, taken out of the queue, each with
        its predicted wait and a booked Retry-After: they are refused as soon as that is known, not at the end
        of their budget."""
        rate = self.drain.per_second(now)
        if not self.drain.mature(now) or rate <= 0:
            return []
        self.returns.forget(now)
        doomed: list[tuple[Ticket, float, float]] = []
        for position, ticket in enumerate(self.queue.in_order(), start=1):
            predicted = (position - len(doomed)) / rate  # those refused before it leave the line too
            if not ticket.retry:
                predicted += self.returns.due(now, now + predicted, ticket.tenant) / rate
            if now + predicted > ticket.deadline:
                doomed.append((ticket, predicted, self.book_return(now, predicted, ticket.tenant)))
        for ticket, _, _ in doomed:
            self.queue.remove(ticket)
        return doomed

    def book_return(self, now: float, line_wait_s: float, tenant: str = "") -> float:
        """The Retry-After of ``tenant``'s request refused for want of time: when the line it saw is gone, and
        after every return booked before it, one finish apart."""
        rate = self.drain.per_second(now)
        spacing = 1.0 / rate if rate > 0 else 1.0
        at = self.returns.book(now + max(line_wait_s, 1.0), spacing, latest=now + HONOURED_RETRY_AFTER_S, tenant=tenant)
        return min(at - now, 600.0)

    def eta(self, position: int, now: float) -> float | None:
        """Seconds until ``position`` requests ahead have drained at the observed finish rate (None: unknown)."""
        rate = self.drain.per_second(now)
        return position / rate if rate > 0 else None

    def retry_after(self, position: int, now: float) -> float:
        """Seconds until ``position`` requests ahead have drained, from the observed finish rate once it is
        known well enough (a few finishes together read as a rate of tens a second)."""
        rate = self.drain.per_second(now)
        if rate <= 0 or not self.drain.mature(now):
            return min(self.config.queue_max_wait_s, 5.0)
        return min(max(position / rate, 1.0), 60.0)
