"""Whether the local tokenizer counts as the engine does. Pure: no clock, no I/O.

A tokenizer of another model (a wrong ``--tokenizer``, a stale model directory, an HF cache snapshot of a
different revision) loads without complaint and counts every prompt wrong: a Llama-2-sized vocabulary counts a
Llama-3 prompt twice over, and kvgate then refuses prompts the engine would serve (context length, token ids
"out of vocabulary"). Nothing else says so: the engine's ``usage.prompt_tokens`` is right, and the fast path
learns from it. So every prompt counted locally is compared with what the engine counted for it; when most of
the recent ones disagree by more than a chat template's framing could explain, the tokenizer is not the
engine's.
"""

from __future__ import annotations

import statistics
from collections import deque

TOLERANCE = 0.1  # of the engine's count: more than this apart is a disagreement...
SLACK_TOKENS = 16  # ...and more than this (a template's date header, a default system prompt, BOS)


class CountAgreement:
    """The last ``window`` comparisons of a local count with the engine's; :attr:`disagrees` once at least half
    a window of them is in and more than half of those disagree."""

    def __init__(self, window: int = 32) -> None:
        self._window = window
        self._recent: deque[tuple[bool, float]] = deque()  # (disagreed, engine / ours)
        self._disagreeing = 0
        self.disagrees = False

    def observe(self, ours: int, engine: int) -> bool:
        """One prompt: counted ``ours`` here, ``engine`` by the engine. True when this changes :attr:`disagrees`."""
        if ours <= 0 or engine <= 0:
            return False
        apart = abs(engine - ours) > max(SLACK_TOKENS, TOLERANCE * engine)
        if len(self._recent) == self._window:
            self._disagreeing -= self._recent.popleft()[0]
        self._recent.append((apart, engine / ours))
        self._disagreeing += apart
        now = len(self._recent) * 2 >= self._window and self._disagreeing * 2 > len(self._recent)
        changed, self.disagrees = now != self.disagrees, now
        return changed

    def median_ratio(self) -> float | None:
        """The engine's count over ours, the median of the recent comparisons (None before the first)."""
        return statistics.median(r for _, r in self._recent) if self._recent else None

    def __len__(self) -> int:
        return len(self._recent)
