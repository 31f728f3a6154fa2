"""The admission queue: who goes next when capacity frees up.

FIFO for now. Strict order is deliberate: letting small requests overtake a large one at the head would
starve long prompts forever under sustained load.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from gateway.cost import RequestCost


@dataclass(eq=False, slots=True)
class Ticket:
    """One waiting request. ``deadline`` is absolute, on the controller's clock."""

    cost: RequestCost
    tenant: str
    enqueued_at: float
    deadline: float
    id: int = field(default=0)


class AdmissionQueue:
    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self._items: OrderedDict[int, Ticket] = OrderedDict()
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Ticket]:
        return iter(self._items.values())

    @property
    def is_full(self) -> bool:
        return len(self._items) >= self.max_length

    def push(self, ticket: Ticket) -> bool:
        if self.is_full:
            return False
        self._next_id += 1
        ticket.id = self._next_id
        self._items[ticket.id] = ticket
        return True

    def peek(self) -> Ticket | None:
        return next(iter(self._items.values()), None)

    def pop(self) -> Ticket:
        return self._items.popitem(last=False)[1]

    def remove(self, ticket: Ticket) -> bool:
        return self._items.pop(ticket.id, None) is not None

    def position(self, ticket: Ticket) -> int:
        """1-based place in line (0 if not queued). O(n); only used for responses, not decisions."""
        for i, t in enumerate(self._items.values(), 1):
            if t is ticket:
                return i
        return 0

    def expired(self, now: float) -> list[Ticket]:
        """Remove and return every ticket whose deadline has passed."""
        gone = [t for t in self._items.values() if t.deadline <= now]
        for t in gone:
            del self._items[t.id]
        return gone

    def blocks_ahead(self, ticket: Ticket) -> int:
        total = 0
        for t in self._items.values():
            if t is ticket:
                break
            total += t.cost.blocks
        return total
