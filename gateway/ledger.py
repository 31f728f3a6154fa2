"""The reservation ledger: blocks the gateway has promised to requests in flight.

A usage sample from ``/metrics`` is a picture of the past. The ledger is what fills the gap until the next
one: for every admitted request it knows how many blocks the request may grow to and how many the latest
sample already shows (only once the request's first token was seen before that sample started is its
progress known to be inside it). ``outstanding_blocks`` is the difference: what the engine may still
allocate that no sample has shown yet.

Every reservation is released exactly once: :meth:`Ledger.release` answers False on a second call, and the
counters let tests check that nothing is left behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.cost import RequestCost


@dataclass(slots=True, eq=False)
class Reservation:
    id: int
    cost: RequestCost
    tenant: str
    admitted_at: float
    first_token_at: float | None = None
    generated: int = 0
    in_sample_blocks: int = 0
    pending_sample_blocks: int = 0
    released: bool = field(default=False)

    @property
    def blocks(self) -> int:
        return self.cost.blocks


class Ledger:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._live: dict[int, Reservation] = {}
        self._next_id = 0
        self.reserved_blocks = 0
        self._in_sample_blocks = 0
        self.reserved_count = 0
        self.released_count = 0

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._live.values()))

    @property
    def outstanding_blocks(self) -> int:
        """Blocks reserved that the latest sample does not show yet (in-flight credit plus decode growth)."""
        return self.reserved_blocks - self._in_sample_blocks

    def reserve(self, cost: RequestCost, tenant: str, now: float) -> Reservation:
        self._next_id += 1
        res = Reservation(self._next_id, cost, tenant, admitted_at=now)
        self._live[res.id] = res
        self.reserved_blocks += res.blocks
        self.reserved_count += 1
        return res

    def progress(self, res: Reservation, generated: int, now: float) -> None:
        """Record output seen so far (tokens over all sequences); the first call marks the first token."""
        if res.released or generated <= res.generated:
            return
        if res.first_token_at is None:
            res.first_token_at = now
        res.generated = generated

    def release(self, res: Reservation) -> bool:
        """Return the reservation's blocks. True the first time, False on any later call."""
        if res.released:
            return False
        res.released = True
        del self._live[res.id]
        self.reserved_blocks -= res.blocks
        self._in_sample_blocks -= res.in_sample_blocks
        self.released_count += 1
        return True

    def begin_sample(self) -> None:
        """A scrape starts now: note how much of each request the engine certainly holds at this moment."""
        for res in self._live.values():
            if res.first_token_at is None:
                res.pending_sample_blocks = 0
            else:
                res.pending_sample_blocks = min(
                    res.blocks, res.cost.blocks_after(res.generated, self.block_size)
                )

    def commit_sample(self) -> None:
        """The scrape begun by :meth:`begin_sample` succeeded: its picture now includes those blocks."""
        total = 0
        for res in self._live.values():
            res.in_sample_blocks = res.pending_sample_blocks
            total += res.in_sample_blocks
        self._in_sample_blocks = total

    def set_block_size(self, block_size: int) -> None:
        self.block_size = block_size
