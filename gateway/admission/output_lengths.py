"""How long outputs really are: an online distribution of completion lengths, learned from finished requests.
Pure: no clock, no I/O.

Clients send no ``max_tokens`` or a generous one, and models stop long before it, so reserving every request at
its cap keeps the engine half empty. This module answers "how many output tokens will this request most likely
need, at quantile ``q``", per (model, endpoint, tenant), falling back to coarser keys ((model, endpoint), then
(model,), then everything) while a key has fewer than ``min_samples`` observations, and to None (reserve the
cap) while even the coarsest has too few. A request that outruns its estimate asks again with ``above=`` the
tokens it has already produced: the quantile of the lengths that went at least that far.

Each key keeps its last ``window`` observations in a sorted list, so a quantile is a bisect and a lookup and the
distribution follows a shift in the traffic within one window. Keys come from requests the engine served, and
their number is bounded (least recently observed dropped first).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque

Key = tuple[str, ...]


class _Window:
    """The last ``size`` lengths, in arrival order (to evict) and sorted (to answer)."""

    def __init__(self, size: int) -> None:
        self._order: deque[int] = deque()
        self._sorted: list[int] = []
        self._size = size

    def __len__(self) -> int:
        return len(self._order)

    def add(self, value: int) -> None:
        if len(self._order) == self._size:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._order.append(value)
        bisect.insort(self._sorted, value)

    def quantile(self, q: float, above: int, min_samples: int) -> int | None:
        """The ``q`` quantile of the lengths greater than ``above`` (None: fewer than ``min_samples`` of them)."""
        start = bisect.bisect_right(self._sorted, above)
        n = len(self._sorted) - start
        if n < min_samples:
            return None
        return self._sorted[start + min(n - 1, math.ceil(q * n) - 1 if q > 0 else 0)]


class OutputLengths:
    def __init__(self, *, window: int = 512, min_samples: int = 32, max_keys: int = 1024) -> None:
        self.window = window
        self.min_samples = min_samples
        self.max_keys = max_keys
        self._windows: OrderedDict[Key, _Window] = OrderedDict()

    def observe(self, key: Key, tokens: int) -> None:
        """A finished request produced ``tokens`` output tokens per sequence; every coarser key learns it too."""
        for depth in range(len(key) + 1):
            sub = key[:depth]
            window = self._windows.get(sub)
            if window is None:
                window = self._windows[sub] = _Window(self.window)
                if len(self._windows) > self.max_keys:
                    self._evict()
            else:
                self._windows.move_to_end(sub)
            window.add(max(0, tokens))

    def _evict(self) -> None:
        for old in self._windows:
            if old:  # never the root: it is everybody's fallback
                del self._windows[old]
                return

    def quantile(self, key: Key, q: float, above: int = 0) -> int | None:
        """Output tokens per sequence at quantile ``q`` for requests like this one (that already produced
        ``above``), from the most specific key that knows enough; None when none does."""
        for depth in range(len(key), -1, -1):
            window = self._windows.get(key[:depth])
            if window is not None:
                value = window.quantile(q, above, self.min_samples if above == 0 else max(4, self.min_samples // 4))
                if value is not None:
                    return value
        return None

    def samples(self, key: Key) -> int:
        window = self._windows.get(key)
        return 0 if window is None else len(window)
