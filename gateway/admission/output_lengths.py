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

Finished requests alone are a biased sample: short outputs finish first, so right after a cold start or a
shift, and whenever the long tail takes about as long as the window spans, the window holds the short ones
and the long ones are still running (measured in the simulator: the learned 0.7 quantile sat at the
true 0.55, and half the requests outran their reservation). So the requests still generating count too, as
right-censored observations ("longer than what it has produced so far"): :meth:`OutputLengths.set_in_flight`
hands them in, once per engine sample, and the quantile is then the Kaplan-Meier estimate over both. Those
answers are cached until the next :meth:`set_in_flight` (a fraction of a second), so an admission is still a
dictionary lookup.

Requests that were stopped before they ended on their own are censored the same way, and kept in the window
with the ended ones (``ended=False``): one that ran into its budget (``max_tokens``) or whose client went away
mid-stream is known only to be longer than what it produced. Dropping them would bias the window the same way:
when a tenant caps its outputs at 300 tokens and most answers would run longer, the capped ones are most of the
traffic, and the ended ones alone put the quantile well under the cap that most requests then run to.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Iterable

Key = tuple[str, ...]
MAX_CACHED = 4096  # cached censored quantiles between two samples (outran requests ask with their own ``above``)
BEYOND = 2**31 - 1  # the quantile lies past every length seen to end: reserve the whole budget
STALE_AFTER = 64  # finished requests without a new in-flight set: the running ones are forgotten (no samples)


class _Window:
    """The last ``size`` observations, in arrival order (to evict) and sorted (to answer): the lengths of the
    requests that ended on their own, and apart from them what the stopped ones (censored) had produced."""

    def __init__(self, size: int) -> None:
        self._order: deque[tuple[int, bool]] = deque()  # (tokens, ended)
        self._sorted: list[int] = []  # ended
        self.stopped: list[int] = []  # censored: stopped after producing that many, sorted
        self._size = size

    def __len__(self) -> int:
        return len(self._order)

    def add(self, value: int, ended: bool = True) -> None:
        if len(self._order) == self._size:
            old, old_ended = self._order.popleft()
            values = self._sorted if old_ended else self.stopped
            del values[bisect.bisect_left(values, old)]
        self._order.append((value, ended))
        bisect.insort(self._sorted if ended else self.stopped, value)

    def quantile(self, q: float, above: int, min_samples: int) -> int | None:
        """The ``q`` quantile of the lengths greater than ``above`` (None: fewer than ``min_samples`` of them),
        when nothing is censored."""
        start = bisect.bisect_right(self._sorted, above)
        n = len(self._sorted) - start
        if n < min_samples:
            return None
        return self._sorted[start + min(n - 1, math.ceil(q * n - 1e-9) - 1 if q > 0 else 0)]

    def censored_quantile(self, q: float, above: int, min_samples: int, running: list[int]) -> int | None:
        """The Kaplan-Meier ``q`` quantile of the lengths greater than ``above``, when ``running`` (sorted) are
        the tokens produced so far by requests that have not finished and :attr:`stopped` those of requests that
        were stopped: each is known only to end past that. :data:`BEYOND` when so many are censored that the
        survival never falls to ``1 - q`` (the quantile lies past anything seen to end), or when fewer than
        ``min_samples`` ended past ``above`` but with the stopped ones the window holds that many (a tenant
        whose cap stops most of its answers: not another key's shorter lengths); None when it holds fewer."""
        finished = self._sorted
        i = bisect.bisect_right(finished, above)
        if len(finished) - i < min_samples:
            stopped = len(self.stopped) - bisect.bisect_left(self.stopped, above)
            return BEYOND if len(finished) - i + stopped >= min_samples else None
        censored = sorted(running + self.stopped) if self.stopped else running
        survival, target = 1.0, 1.0 - q + 1e-12
        while i < len(finished):
            t = finished[i]
            ends_here = bisect.bisect_right(finished, t, i) - i
            # at risk of ending at t: ended at t or later, or censored with at least t - 1 produced
            at_risk = len(finished) - i + len(censored) - bisect.bisect_left(censored, t - 1)
            survival *= 1.0 - ends_here / at_risk
            if survival <= target:
                return t
            i += ends_here
        return BEYOND

    def observed_quantile(self, q: float, min_samples: int) -> int | None:
        """The ``q`` quantile of every length above 0 seen, a stopped one at what it had produced: each true
        length is at least that, so this errs short (and is what is known of a key whose answers mostly run to a
        cap). None: fewer than ``min_samples`` of them."""
        values = sorted(self._sorted + self.stopped)
        values = values[bisect.bisect_right(values, 0) :]
        if len(values) < min_samples:
            return None
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values) - 1e-9) - 1))]  # as censored_quantile's


class OutputLengths:
    def __init__(self, *, window: int = 512, min_samples: int = 32, max_keys: int = 1024) -> None:
        self.window = window
        self.min_samples = min_samples
        self.max_keys = max_keys
        self._windows: OrderedDict[Key, _Window] = OrderedDict()
        self._running: dict[Key, list[int]] = {}  # per key (and every coarser one): tokens so far, sorted
        self._cached: dict[tuple[Key, float, int], int | None] = {}
        self._observed_since = 0  # finished requests observed since the last in-flight set

    def set_in_flight(self, running: Iterable[tuple[Key, int]]) -> None:
        """The requests still generating, as (key, tokens produced so far per sequence): they replace the
        previous set, and the quantiles are worked out afresh."""
        by_key: dict[Key, list[int]] = {}
        for key, produced in running:
            for depth in range(len(key) + 1):
                by_key.setdefault(key[:depth], []).append(produced)
        for values in by_key.values():
            values.sort()
        self._running = by_key
        self._cached.clear()
        self._observed_since = 0

    def observe(self, key: Key, tokens: int, *, ended: bool = True) -> None:
        """A finished request produced ``tokens`` output tokens per sequence; every coarser key learns it too.
        ``ended=False``: it was stopped (its budget, its client) after producing them, so its length is only
        known to be longer. Cached answers keep until the next in-flight set; if none comes (the engine's
        metrics are down), they and the running ones are forgotten after ``STALE_AFTER`` finishes."""
        self._observed_since += 1
        if self._observed_since >= STALE_AFTER:
            self.set_in_flight(())
        for depth in range(len(key) + 1):
            sub = key[:depth]
            window = self._windows.get(sub)
            if window is None:
                window = self._windows[sub] = _Window(self.window)
                if len(self._windows) > self.max_keys:
                    self._evict()
            else:
                self._windows.move_to_end(sub)
            window.add(max(0, tokens), ended)

    def _evict(self) -> None:
        for old in self._windows:
            if old:  # never the root: it is everybody's fallback
                del self._windows[old]
                return

    def quantile(self, key: Key, q: float, above: int = 0) -> int | None:
        """Output tokens per sequence at quantile ``q`` for requests like this one (that already produced
        ``above``), from the most specific key that knows enough; None when none does; :data:`BEYOND` when
        requests still running or stopped say it lies past every length seen to end (no coarser key is asked
        then: their lengths are not this key's)."""
        min_samples = self.min_samples if above == 0 else max(4, self.min_samples // 4)
        for depth in range(len(key), -1, -1):
            sub = key[:depth]
            window = self._windows.get(sub)
            if window is None:
                continue
            running = self._running.get(sub)
            if running is None and not window.stopped:
                value = window.quantile(q, above, min_samples)
            elif (sub, q, above) in self._cached:
                value = self._cached[sub, q, above]
            else:
                value = window.censored_quantile(q, above, min_samples, running or [])
                if len(self._cached) >= MAX_CACHED:
                    self._cached.clear()
                self._cached[sub, q, above] = value
            if value is not None:
                return value
        return None

    def at_least(self, key: Key, q: float) -> int | None:
        """What :meth:`quantile` is when it says :data:`BEYOND`, short: the ``q`` quantile of what requests
        like this one produced, the stopped ones counted at what they had produced when stopped (see
        :meth:`_Window.observed_quantile`), from the most specific key that knows enough (the one
        :meth:`quantile` answered from: a new tenant's are its model and route's); None when none does. Kept,
        like the censored quantiles, until the next in-flight set."""
        for depth in range(len(key), -1, -1):
            sub = key[:depth]
            window = self._windows.get(sub)
            if window is None:
                continue
            if (sub, q, -1) not in self._cached:
                if len(self._cached) >= MAX_CACHED:
                    self._cached.clear()
                self._cached[sub, q, -1] = window.observed_quantile(q, self.min_samples)
            if (value := self._cached[sub, q, -1]) is not None:
                return value
        return None

    def samples(self, key: Key) -> int:
        window = self._windows.get(key)
        return 0 if window is None else len(window)
