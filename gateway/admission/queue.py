"""The admission queue: who goes next when capacity frees up. Pure: no clock, no I/O.

* Strict priority between classes (critical, standard, sheddable): a lower class is served only while every
  higher class is empty.
* Inside a class, weighted fair sharing between tenants *in tokens*, by start-time fair queuing (SFQ): each
  ticket gets a virtual start tag ``max(V, the tenant's last finish)`` and a finish tag ``start + tokens /
  weight``; the ticket with the smallest start tag goes next and ``V`` moves to it. So while two tenants
  both have tickets waiting, each is served tokens in proportion to its weight however fast it sends, and a
  tenant that was idle gets no credit for the idle time.
* FIFO inside a tenant (its tags only grow), except that a retry (a request that was refused and came back
  after its Retry-After, as the OpenAI SDKs say with ``x-stainless-retry-count``) goes ahead of the tenant's
  first attempts in its class: it has waited once already, and a Retry-After is a promise only if the line it
  comes back to does not start behind everyone who arrived meanwhile. It takes the first attempt's tags and
  pushes the tenant's later tickets back by its own share, so the tenant's share of the class is unchanged:
  a client that claims to retry can only overtake its own tenant.
* Head-of-line: the next ticket is served when *it* fits; smaller ones do not overtake it, which would starve
  long prompts under sustained load.
* When the queue is full, an arrival may push out a ticket of a strictly lower class: the newest ticket of the
  heaviest tenant of the lowest class (sheddable first). Otherwise the arrival is refused.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from gateway.tokens.cost import RequestCost

PRIORITIES: tuple[str, ...] = ("critical", "standard", "sheddable")
STANDARD = 1


def priority_rank(name: str | None) -> int:
    return PRIORITIES.index(name) if name is not None else STANDARD


def engine_priority(rank: int) -> int:
    """vLLM's request priority for a class (lower is served first, 0 is its default): critical -1, standard 0,
    sheddable 1."""
    return rank - STANDARD


@dataclass(frozen=True, slots=True)
class QueueClass:
    """How a tenant's tickets are queued: its class (0 = critical), fair-share weight and queue limit."""

    priority: int = STANDARD
    weight: float = 1.0
    max_queued: int | None = None


@dataclass(eq=False, slots=True)
class Ticket:
    """One waiting request. ``deadline`` is absolute, on the controller's clock; tags are virtual time."""

    cost: RequestCost
    tenant: str
    enqueued_at: float
    deadline: float
    id: int = field(default=0)
    qclass: QueueClass = field(default_factory=QueueClass)
    body_bytes: int = 0  # the request body it keeps while it waits
    full: RequestCost | None = None  # the request's whole budget, when ``cost`` is only what it is expected to use
    key: tuple[str, ...] = ()  # (model, endpoint, tenant): whose output lengths it is estimated from
    retry: bool = False  # came back after a refusal: queued ahead of its tenant's first attempts
    prefix: tuple[int, ...] = ()  # its prompt's chunk hashes, for prefix affinity in a pool
    eta_s: float | None = None  # the wait it was told to expect on arrival (None: the finish rate was unknown)
    arrived_at: float | None = None  # when the request first arrived, if it queued again (a shared claim refused)
    start: float = 0.0
    finish: float = 0.0

    @property
    def priority(self) -> int:
        return self.qclass.priority

    @property
    def tokens(self) -> int:
        return max(1, self.cost.total_tokens)


@dataclass(frozen=True, slots=True)
class Pushed:
    """The ticket is queued; ``shed`` are tickets it pushed out (their requests must be failed)."""

    shed: tuple[Ticket, ...] = ()


@dataclass(frozen=True, slots=True)
class Refused:
    reason: Literal["queue_full", "tenant_queue_full"]


class _Class:
    """One priority class: per-tenant FIFOs and the class's virtual time."""

    def __init__(self) -> None:
        self.vtime = 0.0
        self.fifos: dict[str, deque[Ticket]] = {}
        self.last_finish: dict[str, float] = {}
        self.size = 0

    def push(self, ticket: Ticket) -> None:
        fifo = self.fifos.setdefault(ticket.tenant, deque())
        self.size += 1
        share = ticket.tokens / ticket.qclass.weight
        index = self.first_attempt(ticket.tenant) if ticket.retry else None
        if index is None:
            ticket.start = max(self.vtime, self.last_finish.get(ticket.tenant, 0.0))
            ticket.finish = ticket.start + share
            self.last_finish[ticket.tenant] = ticket.finish
            fifo.append(ticket)
            return
        ticket.start = fifo[index].start
        ticket.finish = ticket.start + share
        for t in list(fifo)[index:]:
            t.start += share
            t.finish += share
        self.last_finish[ticket.tenant] = self.last_finish.get(ticket.tenant, 0.0) + share
        fifo.insert(index, ticket)

    def first_attempt(self, tenant: str) -> int | None:
        """Where in ``tenant``'s line its first queued first attempt stands (None: it has none queued)."""
        for index, t in enumerate(self.fifos.get(tenant, ())):
            if not t.retry:
                return index
        return None

    def head(self) -> Ticket | None:
        best: Ticket | None = None
        for fifo in self.fifos.values():
            t = fifo[0]
            if best is None or (t.start, t.id) < (best.start, best.id):
                best = t
        return best

    def pop(self, ticket: Ticket) -> None:
        self._take(ticket)
        self.vtime = max(self.vtime, ticket.start)
        # A tenant whose last finish is behind V would start at V anyway: forget it (bounded memory).
        for tenant in [t for t, f in self.last_finish.items() if f <= self.vtime and t not in self.fifos]:
            del self.last_finish[tenant]

    def remove(self, ticket: Ticket) -> None:
        """Take out a ticket that was not served: the tenant's later tickets move up by its share."""
        fifo = self.fifos[ticket.tenant]
        index = fifo.index(ticket)
        self._take(ticket)
        delta = ticket.finish - ticket.start
        for t in list(fifo)[index:]:
            t.start -= delta
            t.finish -= delta
        self.last_finish[ticket.tenant] = self.last_finish.get(ticket.tenant, 0.0) - delta

    def _take(self, ticket: Ticket) -> None:
        fifo = self.fifos[ticket.tenant]
        fifo.remove(ticket)
        if not fifo:
            del self.fifos[ticket.tenant]
        self.size -= 1

    def victim(self) -> Ticket | None:
        """The newest ticket of the tenant furthest ahead of its share."""
        tails = [fifo[-1] for fifo in self.fifos.values()]
        return max(tails, key=lambda t: (t.finish, t.id), default=None)


def _serving_order(t: Ticket) -> tuple[int, float, int]:
    return (t.priority, t.start, t.id)


class AdmissionQueue:
    """Bounded in tickets and in the request bytes they hold, so client input cannot grow it without limit."""

    def __init__(self, max_length: int, max_bytes: int | None = None) -> None:
        self.max_length = max_length
        self.max_bytes = max_bytes
        self.bytes = 0
        self._classes = [_Class() for _ in PRIORITIES]
        self._by_id: dict[int, Ticket] = {}
        self._per_tenant: dict[str, int] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def __iter__(self) -> Iterator[Ticket]:
        return iter(list(self._by_id.values()))

    @property
    def is_full(self) -> bool:
        return len(self._by_id) >= self.max_length

    def tenant_len(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    def tenant_lengths(self) -> dict[str, int]:
        """Waiting tickets per tenant (tenants with none are absent)."""
        return {tenant: n for tenant, n in self._per_tenant.items() if n}

    def waiting_at_or_above(self, priority: int) -> bool:
        """Whether a ticket of this class or a higher one is waiting (an arrival must queue behind it)."""
        return any(c.size for c in self._classes[: priority + 1])

    def push(self, ticket: Ticket) -> Pushed | Refused:
        q = ticket.qclass
        if q.max_queued is not None and self.tenant_len(ticket.tenant) >= q.max_queued:
            return Refused("tenant_queue_full")
        if self.max_bytes is not None and self.bytes + ticket.body_bytes > self.max_bytes:
            return Refused("queue_full")
        shed: list[Ticket] = []
        if self.is_full:
            victim = self._lowest_below(ticket.priority)
            if victim is None or self.max_length == 0:
                return Refused("queue_full")
            self.remove(victim)
            shed.append(victim)
        self._next_id += 1
        ticket.id = self._next_id
        self._classes[ticket.priority].push(ticket)
        self._by_id[ticket.id] = ticket
        self.bytes += ticket.body_bytes
        self._per_tenant[ticket.tenant] = self.tenant_len(ticket.tenant) + 1
        return Pushed(tuple(shed))

    def _lowest_below(self, priority: int) -> Ticket | None:
        for rank in range(len(PRIORITIES) - 1, priority, -1):
            victim = self._classes[rank].victim()
            if victim is not None:
                return victim
        return None

    def peek(self) -> Ticket | None:
        for cls in self._classes:
            if cls.size:
                return cls.head()
        return None

    def pop(self) -> Ticket:
        ticket = self.peek()
        if ticket is None:
            raise IndexError("pop from an empty queue")
        self.serve(ticket)
        return ticket

    def serve(self, ticket: Ticket) -> None:
        """Take ``ticket`` out as served (the head, or one let past a head that waits for an engine): its
        tenant has had its share, unlike a ticket :meth:`remove` takes out unserved."""
        self._classes[ticket.priority].pop(ticket)
        self._forget(ticket)

    def remove(self, ticket: Ticket) -> bool:
        if self._by_id.get(ticket.id) is not ticket:
            return False
        self._classes[ticket.priority].remove(ticket)
        self._forget(ticket)
        return True

    def _forget(self, ticket: Ticket) -> None:
        del self._by_id[ticket.id]
        self.bytes -= ticket.body_bytes
        left = self._per_tenant[ticket.tenant] - 1
        if left:
            self._per_tenant[ticket.tenant] = left
        else:
            del self._per_tenant[ticket.tenant]

    def position(self, ticket: Ticket) -> int:
        """1-based place in line if nobody else arrived (0 if not queued). O(n): for responses only."""
        if self._by_id.get(ticket.id) is not ticket:
            return 0
        key = (ticket.priority, ticket.start, ticket.id)
        return 1 + sum(1 for t in self._by_id.values() if (t.priority, t.start, t.id) < key)

    def prospective_position(self, tenant: str, priority: int, retry: bool = False) -> int:
        """The place in line a new ticket of ``tenant`` in class ``priority`` would take, without queueing it."""
        cls = self._classes[priority]
        index = cls.first_attempt(tenant) if retry else None
        if index is None:
            start = max(cls.vtime, cls.last_finish.get(tenant, 0.0))
            return 1 + sum(1 for t in self._by_id.values() if (t.priority, t.start) <= (priority, start))
        start = cls.fifos[tenant][index].start  # it would take that first attempt's place, and push it back
        return 1 + sum(
            1
            for t in self._by_id.values()
            if (t.priority, t.start) <= (priority, start)
            and not (t.tenant == tenant and t.priority == priority and not t.retry)
        )

    def in_order(self, first: int | None = None) -> list[Ticket]:
        """Every waiting ticket (or the ``first`` ones) in the order it would be served if nothing else arrived."""
        if first is not None:  # without sorting the whole queue: a replica restates its front at every release
            return heapq.nsmallest(first, self._by_id.values(), key=_serving_order)
        return sorted(self._by_id.values(), key=_serving_order)

    def expired(self, now: float) -> list[Ticket]:
        """Remove and return every ticket whose deadline has passed."""
        gone = [t for t in self._by_id.values() if t.deadline <= now]
        for t in gone:
            self.remove(t)
        return gone
