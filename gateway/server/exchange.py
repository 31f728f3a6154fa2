"""One object per request: everything it holds, released and settled exactly once when it ends.

An :class:`Exchange` is opened when a request arrives and closed when its handler returns, however it returns
(answered, refused, engine error, client gone). On the way it takes, in order, a rate-limit charge, a tenant
concurrency slot and a KV reservation, and records how far the engine's answer got. Closing it derives the
outcome from how it ended, then gives back the reservation and the slot and settles the charge against what was
really used. Each step is guarded by the exchange's own state, so nothing is given back twice or forgotten.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Literal

from gateway.admission.admitter import Admission, Admitter
from gateway.metrics import GatewayMetrics
from gateway.protocol.errors import GatewayError, answer_outlasts_timeout
from gateway.server.hints import CLIENT_MARGIN_S, NO_HINTS
from gateway.server.response import ResponseWriter
from gateway.server.settle import stream_lead, tokens_streamed, tokens_used
from gateway.tenants.counters import Charge, TenantCounters
from gateway.tenants.policy import TenantPolicy
from gateway.tenants.ratelimit import ratelimit_headers
from gateway.tenants.slots import Slot
from gateway.tokens.cost import RequestCost
from gateway.upstream.forwarder import EngineBusy, EngineUnreachable, Usage

Stage = Literal["body", "waiting", "queued", "streaming"]
MAX_BUSY_REFUSALS = 5  # times the engine may turn one request away as busy before its client hears so
Outcome = Literal["completed", "client_disconnect", "upstream_busy", "upstream_error", "engine_unreachable", "error"]


class Exchange:
    def __init__(
        self,
        request_id: str,
        writer: ResponseWriter,
        *,
        engine_request_id: str | None = None,
        admitter: Admitter,
        counters: TenantCounters,
        metrics: GatewayMetrics,
    ) -> None:
        self.request_id = request_id
        self.engine_request_id = engine_request_id or request_id  # what the engine knows it by
        self.writer = writer
        self._admitter = admitter
        self._counters = counters
        self._metrics = metrics
        self._stage: Stage = "body"
        self.body_bytes = 0
        self.tenant: TenantPolicy | None = None
        self.cost: RequestCost | None = None
        self.key: tuple[str, ...] = ()  # (model, route, tenant): whose output lengths estimate this one
        self.prefix: tuple[int, ...] = ()  # its prompt's chunk hashes: prefix affinity in a pool
        self.client = NO_HINTS  # what the client's headers say about waiting
        self.charge: Charge | None = None
        self.slot: Slot | None = None
        self.slot_wait_s = 0.0
        self._waiting_since = 0.0  # loop time its wait for a slot and a reservation began
        self.admission: Admission | None = None
        self.reached_engine = False
        self.stream_interval = 1  # tokens per SSE event the engine batches (vLLM's stream_interval)
        self.chat = False  # its stream opens with role chunks that carry no token
        self.whole_answer = False  # answered in one piece (not a stream): see wait_budget_s
        self.answer_s = 0.0  # the time its answer (a stream: its first event) takes once admitted, kept out of its wait
        self.generated = 0  # output tokens relayed so far, at least (from the SSE events)
        self.usage: Usage | None = None
        self.broke_off = False  # its 200 stream ended in the engine's error event
        self.busy_refusals = 0  # times the engine turned it away as busy (its queue full)
        self.outcome: Outcome | None = None  # set once, when the exchange closes

    @property
    def stage(self) -> Stage:
        """Where the request is: reading its body, being prepared or waiting for the engine, queued, streaming."""
        return "streaming" if self.writer.started else self._stage

    def body_read(self, size: int) -> None:
        self.body_bytes = size
        self._stage = "waiting"

    # --- what the request takes, in order ------------------------------------------------------------

    async def charge_rate_limits(self, tenant: TenantPolicy, cost: RequestCost, key: tuple[str, ...] = ()) -> None:
        """Pre-charge the tenant's per-minute limits with prompt + reserved output (429 over a limit)."""
        self.tenant, self.cost, self.key = tenant, cost, key
        if self.client.read_timeout:  # see wait_budget_s
            if self.whole_answer:
                self.answer_s = self._admitter.answer_s(cost, key)
                timeout_s = (self.client.wait_s or 0.0) + CLIENT_MARGIN_S
                if (certain_s := self._admitter.certain_answer_s(cost)) >= timeout_s:
                    raise answer_outlasts_timeout(cost.max_output, certain_s, timeout_s)
            else:  # a stream's head waits for its first event, which the engine's prefill must make first
                self.answer_s = self._admitter.first_event_s()
        self.charge = await self._counters.check(tenant, cost.charge_tokens, cost.least_charge_tokens)

    async def take_slot(self) -> None:
        """One of the tenant's concurrency slots, if it has a limit; waits within the tenant's wait budget."""
        tenant = self._tenant()
        if tenant.max_concurrent is None:  # no limit, no slot: skip the clock and the call
            return
        self._stage = "queued"
        started = asyncio.get_running_loop().time()
        self.slot = await self._counters.acquire_slot(
            tenant, self.wait_budget_s, lambda: self._admitter.queued(tenant.tenant)
        )
        self.slot_wait_s = asyncio.get_running_loop().time() - started
        self._stage = "waiting"

    async def admit(self) -> None:
        """A KV reservation: admitted now, or after waiting in the queue for what is left of the wait budget."""
        self._waiting_since = asyncio.get_running_loop().time() - self.slot_wait_s
        await self._admit(self.slot_wait_s, self.client.retry)

    async def _admit(self, waited_s: float, retry: bool) -> None:
        tenant = self._tenant()
        assert self.cost is not None
        self._stage = "queued"
        try:
            self.admission = await self._admitter.acquire(
                self.cost,
                tenant.tenant,
                max(0.0, self.wait_budget_s - waited_s),
                tenant.qclass,
                self.body_bytes,
                self.key,
                retry,
                self.prefix,
            )
        except GatewayError as exc:
            if self.answer_s > 0 and exc.code in ("queue_wait_predicted", "queue_timeout"):
                exc.extra["answer_eta_s"] = round(self.answer_s, 3)  # the part of its budget its answer needs
            raise
        self._stage = "waiting"

    @property
    def engine(self) -> str:
        """The engine of the pool the request was placed on."""
        assert self.admission is not None, "admit() comes first"
        return self.admission.reservation.engine

    async def place_again(self) -> bool:
        """The engine refused the connection, so nothing was sent: eject it and place the request again, on
        another engine, with what is left of its wait budget (its reservation there is given back first).
        False in a pool of one, where there is nowhere else to go."""
        assert self.admission is not None
        self.reached_engine = False  # refused: it holds the engine nothing, and its charge is given back
        if not self._admitter.unreachable(self.engine):
            return False
        await self._admit(self._give_back("engine_unreachable"), retry=True)
        return True

    def _give_back(self, outcome: str) -> float:
        """Its reservation back, unsent (``outcome``), before it is placed again; the seconds it has waited so
        far: all of it counts, every pass through the queue and each attempt (a connection's up to
        connect_timeout_s)."""
        assert self.admission is not None
        self._admitter.release(self.admission.reservation, outcome)
        self.admission = None
        return asyncio.get_running_loop().time() - self._waiting_since

    async def wait_again_after_busy(self) -> bool:
        """The engine turned the request away, its own queue full, before running any of it: nothing was
        generated, and nothing is billed. Admissions to that engine are held until it has room
        (:meth:`Admitter.busy`), its reservation is given back, and it waits in the queue again, ahead of first
        attempts, for what is left of its wait budget (an SDK's own retry would come back later, to the end of
        the line). False when none is left, or it was turned away ``MAX_BUSY_REFUSALS`` times (an engine
        always busy, or a proxy in front of it that keeps saying 429): its client hears that the engine was busy,
        and so it does when its budget runs out in the queue."""
        assert self.admission is not None
        self.reached_engine = False
        self.busy_refusals += 1
        self._admitter.busy(self.engine)
        waited = self._give_back("upstream_busy")
        if waited >= self.wait_budget_s or self.busy_refusals >= MAX_BUSY_REFUSALS:
            return False
        try:
            await self._admit(waited, retry=True)
        except GatewayError as exc:
            if exc.code in ("queue_timeout", "queue_wait_predicted"):
                raise EngineBusy(exc.retry_after_s or 1.0) from exc  # what kept it waiting was the engine's queue
            raise
        return True

    @property
    def wait_budget_s(self) -> float:
        """How long it may wait for a slot and a reservation. A client's read timeout bounds an answer sent in
        one piece as a whole, and a stream up to its first event (its response head waits for it): the time the
        engine will then take to answer, or to prefill, is not for waiting (admitted later, it would time out
        in the engine, and the SDK would send it again)."""
        client_s = self.client.wait_s
        if client_s is not None:
            client_s = max(0.0, client_s - self.answer_s)  # answer_s: worked out with the cost, 0 without a timeout
        return self._tenant().wait_budget(client_s)

    def sending(self) -> None:
        """The request is about to be written to the engine: from here on it may have reached it."""
        self.reached_engine = True

    def progress(self, events: int) -> None:
        """The engine's answer has got this far (SSE events relayed: the tokens they carry at least, give or
        take the events that carry none, a chat's role, the usage, ``[DONE]``); the ledger learns it too."""
        if events == 0:
            return  # nothing has come of the engine's answer yet
        sequences = self.cost.num_sequences if self.cost is not None else 1
        self.generated = tokens_streamed(events, self.stream_interval, sequences)
        if self.admission is not None:
            opening = sequences if self.chat else 0
            lead = stream_lead(events, self.stream_interval, sequences, opening)
            self._admitter.progress(self.admission.reservation, self.generated, lead)

    def reply_headers(self) -> list[tuple[bytes, bytes]]:
        """What the client's response says beside the engine's headers: request id, rate limits, the wait."""
        headers = [(b"x-request-id", self.request_id.encode("latin-1"))]
        if self.charge is not None:
            headers += ratelimit_headers(self.charge.decision)
        admission = self.admission
        if admission is not None and admission.reservation.full.max_output > 0:
            # the output this request was admitted for (per sequence): the learned estimate, or its whole budget
            expected = admission.reservation.cost.max_output
            headers.append((b"x-kvgate-expected-output-tokens", str(expected).encode()))
        if admission is not None and (admission.waited_s > 0 or self.slot_wait_s > 0):
            headers += [
                (b"x-kvgate-queue-position", str(admission.queue_position).encode()),
                (b"x-kvgate-queue-wait-ms", str(round((self.slot_wait_s + admission.waited_s) * 1000)).encode()),
            ]
            if admission.eta_s is not None:
                headers.append((b"x-kvgate-queue-eta-ms", str(round(admission.eta_s * 1000)).encode()))
        return headers

    # --- the end -------------------------------------------------------------------------------------

    async def __aenter__(self) -> Exchange:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(exc)

    def close(self, exc: BaseException | None) -> None:
        """Derive the outcome, release the reservation and the slot, settle the charge. Once."""
        if self.outcome is not None:
            return
        self.outcome = outcome = self._outcome(exc)
        answered = outcome == "completed" and self.writer.status == 200  # an engine error teaches nothing
        whole_answer = answered and not self.writer.event_stream
        if self.admission is not None:
            reservation = self.admission.reservation
            if answered and self.usage is not None:
                # the length the engine said, and for an answer sent whole, how long it took
                self._admitter.learn(reservation, self.usage.completion_tokens, whole=whole_answer)
            elif answered and not whole_answer:
                # a stream without usage: its event count is its length when each event is one token; a batched
                # or speculative stream's is only a floor, which would teach lengths short of the truth: it
                # went at least that far
                exact = self.stream_interval == 1 and self._admitter.events_are_tokens(reservation.engine)
                self._admitter.learn(reservation, self.generated, ended=exact)
            elif outcome == "client_disconnect" and self.writer.event_stream:
                # a stream its client left (a timeout cuts the longest): longer than what it was sent
                self._admitter.learn(reservation, self.generated, ended=False)
            self._admitter.release(reservation, outcome)
        if self.slot is not None:
            self._counters.release_slot(self.slot)
        if self.charge is not None:
            assert self.cost is not None
            generated = self.generated
            if outcome == "client_disconnect" and self.reached_engine and not self.writer.event_stream:
                # an answer sent whole, its client gone before it came: what the engine had time to generate
                # (unknown: as charged), not nothing, or a short client timeout would get around the limit
                by_now = None if self.admission is None else self._admitter.tokens_by_now(self.admission.reservation)
                if by_now is None:
                    whole_answer = True  # billed as charged
                else:  # every sequence had that time, within its own budget
                    generated = sum(min(by_now, budget) for budget in self.cost.output_budgets)
                    generated, whole_answer = generated * self.cost.sequences_per_prompt, False
            used = tokens_used(self.cost, self.usage, generated, self.reached_engine, whole_answer, self.charge.tokens)
            self._counters.settle(self.charge, used, self.reached_engine)
            if self.usage is not None and self.reached_engine:
                self._metrics.prompt_tokens_estimated.inc(sum(self.cost.prompt_tokens))
                self._metrics.prompt_tokens_actual.inc(self.usage.prompt_tokens)
                self._metrics.completion_tokens.inc(self.usage.completion_tokens)

    def _outcome(self, exc: BaseException | None) -> Outcome:
        if exc is None:
            return "upstream_error" if self.broke_off else "completed"
        if isinstance(exc, asyncio.CancelledError):
            return "client_disconnect"
        if isinstance(exc, GatewayError) and exc.code == "engine_busy":
            return "upstream_busy"
        if isinstance(exc, EngineUnreachable):
            return "engine_unreachable"  # nothing was sent: no finish (queue ETAs), no tokens billed
        if isinstance(exc, GatewayError) and self.reached_engine:
            return "upstream_error"
        return "error"

    def _tenant(self) -> TenantPolicy:
        assert self.tenant is not None, "charge_rate_limits() comes first"
        return self.tenant
