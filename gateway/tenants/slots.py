"""Concurrency slots counted in-process: how many requests of a key are admitted and not yet finished. Pure.

Used alone when there is no Redis, and as the fallback (with the limit divided by the replica count) while
Redis is out of reach. Releasing is idempotent per :class:`Slot`, so a slot is given back exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(eq=False, slots=True)
class Slot:
    """One held slot; ``backend`` says which count it is in, so it is returned to the same one."""

    key: str
    backend: Literal["local", "redis", "none"]
    member: str = ""
    released: bool = field(default=False)
    taken_at: float = 0.0  # when it was taken (the counters' clock): how long slots are held, for Retry-After


class HoldTimes:
    """How long each key's slots are held, as a moving average: when a request waiting for one should come
    back (``position`` in line, ``limit`` slots turning over). Bounded by the config's keys."""

    WEIGHT = 0.2  # of the newest hold in the average

    def __init__(self) -> None:
        self._mean: dict[str, float] = {}

    def observe(self, key: str, held_s: float) -> None:
        mean = self._mean.get(key)
        self._mean[key] = held_s if mean is None else mean + self.WEIGHT * (held_s - mean)

    def retry_after(self, key: str, position: int, limit: int) -> float:
        """Seconds until ``position`` requests ahead have had a slot: ``position`` holds shared by ``limit``
        slots, within 1-60 s (1 s before any slot of the key was given back)."""
        mean = self._mean.get(key)
        if mean is None:
            return 1.0
        return min(max(position * mean / max(1, limit), 1.0), 60.0)


class SlotTable:
    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def held(self, key: str) -> int:
        return self._held.get(key, 0)

    def try_acquire(self, key: str, limit: int) -> Slot | None:
        if self.held(key) >= limit:
            return None
        self._held[key] = self.held(key) + 1
        return Slot(key, "local")

    def release(self, slot: Slot) -> bool:
        """True the first time; a second release of the same slot changes nothing."""
        if slot.released or slot.backend != "local":
            return False
        slot.released = True
        left = self._held[slot.key] - 1
        if left:
            self._held[slot.key] = left
        else:
            del self._held[slot.key]
        return True

    def total(self) -> int:
        return sum(self._held.values())
