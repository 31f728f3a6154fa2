"""The asyncio shell around :class:`~gateway.admission.AdmissionController`.

It parks queued requests on futures, wakes them when capacity frees up (a new sample, a finished request),
fails them at their deadline, and guarantees that a reservation is released exactly once: a request that is
cancelled in the instant it gets admitted hands its reservation straight back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from gateway.admission import AdmissionController, Admitted, Queued, UsageSample
from gateway.cost import RequestCost
from gateway.errors import GatewayError, queue_full, queue_timeout
from gateway.ledger import Reservation
from gateway.metrics import GatewayMetrics
from gateway.queue import Ticket


@dataclass(slots=True)
class Admission:
    """A held reservation, plus what the response should say about the wait."""

    reservation: Reservation
    waited_s: float
    queue_position: int
    outcome: str = "completed"


class Admitter:
    def __init__(
        self,
        controller: AdmissionController,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.controller = controller
        self.metrics = metrics
        self.clock = clock
        self._waiters: dict[int, tuple[Ticket, asyncio.Future[Reservation], asyncio.TimerHandle]] = {}

    @asynccontextmanager
    async def reserve(
        self, cost: RequestCost, tenant: str, max_wait_s: float | None = None
    ) -> AsyncIterator[Admission]:
        """Hold a reservation for the body of the ``async with``; it is released however the body ends."""
        admission = await self.acquire(cost, tenant, max_wait_s)
        try:
            yield admission
        except asyncio.CancelledError:
            admission.outcome = "client_disconnect" if admission.outcome == "completed" else admission.outcome
            raise
        except BaseException:
            if admission.outcome == "completed":
                admission.outcome = "error"
            raise
        finally:
            self.release(admission.reservation, admission.outcome)

    async def acquire(self, cost: RequestCost, tenant: str, max_wait_s: float | None = None) -> Admission:
        now = self.clock()
        decision = self.controller.submit(cost, tenant, now, max_wait_s)
        if isinstance(decision, Admitted):
            self._on_admitted(0.0)
            return Admission(decision.reservation, 0.0, 0)
        if not isinstance(decision, Queued):
            self.metrics.rejected.labels(decision.reason).inc()
            raise queue_full(decision.retry_after_s, {"queue_depth": len(self.controller.queue)})
        ticket = decision.ticket
        position = len(self.controller.queue)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Reservation] = loop.create_future()
        timer = loop.call_at(loop.time() + (ticket.deadline - now), self._expire)
        self._waiters[ticket.id] = (ticket, future, timer)
        self.metrics.queue_depth.set(len(self.controller.queue))
        try:
            reservation = await future
        except asyncio.CancelledError:
            self._abandon(ticket, future)
            raise
        waited = self.clock() - ticket.enqueued_at
        self._on_admitted(waited)
        return Admission(reservation, waited, position)

    def _abandon(self, ticket: Ticket, future: asyncio.Future[Reservation]) -> None:
        """The waiting client went away: leave the queue, or give back a reservation granted meanwhile."""
        entry = self._waiters.pop(ticket.id, None)
        if entry is not None:
            entry[2].cancel()
        if self.controller.cancel(ticket):
            self.metrics.client_disconnects.labels("queued").inc()
            self.metrics.queue_depth.set(len(self.controller.queue))
        elif future.done() and not future.cancelled() and future.exception() is None:
            self.release(future.result(), "client_disconnect")
        self.pump()

    def _on_admitted(self, waited_s: float) -> None:
        projected = self.controller.projected_usage(self.clock())
        if projected is not None:
            self.metrics.projected_at_admission.observe(projected)
        self.metrics.admitted.inc()
        self.metrics.queue_wait.observe(waited_s)
        self.metrics.inflight.set(len(self.controller.ledger))

    def release(self, reservation: Reservation, outcome: str) -> None:
        if self.controller.release(reservation, self.clock()):
            self.metrics.released.labels(outcome).inc()
            self.metrics.inflight.set(len(self.controller.ledger))
            self.pump()

    def progress(self, reservation: Reservation, generated: int) -> None:
        self.controller.progress(reservation, generated, self.clock())

    def pump(self) -> None:
        """Wake every queued request that fits now."""
        for ticket, reservation in self.controller.pump(self.clock()):
            _, future, timer = self._waiters.pop(ticket.id)
            timer.cancel()
            if future.done():  # cancelled while we were deciding: give the blocks straight back
                self.metrics.admitted.inc()
                self.release(reservation, "client_disconnect")
            else:
                future.set_result(reservation)
        self.metrics.queue_depth.set(len(self.controller.queue))

    def _expire(self) -> None:
        now = self.clock()
        for ticket in self.controller.expire(now):
            _, future, _ = self._waiters.pop(ticket.id)
            self.metrics.rejected.labels("queue_timeout").inc()
            if not future.done():
                position = 1 + len(self.controller.queue)
                future.set_exception(
                    queue_timeout(self.controller.retry_after(position, now), now - ticket.enqueued_at)
                )
        self.metrics.queue_depth.set(len(self.controller.queue))

    def begin_sample(self) -> None:
        self.controller.begin_sample()

    def on_sample(self, sample: UsageSample) -> None:
        self.controller.apply_sample(sample)
        self.pump()

    def fail_all_queued(self, error: Callable[[float], GatewayError]) -> None:
        """Answer every queued request with ``error`` (shutdown)."""
        now = self.clock()
        for ticket_id in list(self._waiters):
            ticket, future, timer = self._waiters.pop(ticket_id)
            timer.cancel()
            self.controller.cancel(ticket)
            if not future.done():
                future.set_exception(error(self.controller.retry_after(1, now)))
        self.metrics.queue_depth.set(0)

    def refresh_gauges(self) -> None:
        now = self.clock()
        c = self.controller
        self.metrics.gate_open.set(1 if c.gate.is_open else 0)
        if c.sample is not None:
            self.metrics.kv_usage_observed.set(c.sample.usage)
        projected = c.projected_usage(now)
        if projected is not None:
            self.metrics.kv_usage_projected.set(projected)
        self.metrics.reserved_blocks.set(c.ledger.reserved_blocks)
        self.metrics.inflight.set(len(c.ledger))
        self.metrics.queue_depth.set(len(c.queue))
