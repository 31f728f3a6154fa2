"""How long an admitted request takes to be answered, from the requests answered lately. Pure.

A client that reads a whole answer at once (not a stream) under a read timeout, as the OpenAI SDKs do, gets
nothing until the engine has generated all of it: admitted after waiting most of its timeout, it times out
while the engine decodes it, and the SDK sends it again. The engine did the work twice for no answer. So the
time such a request may wait in the queue is its timeout less the time it will then take to be answered:
its expected output length at the pace answers have lately come at (prefill and queueing in the engine
included, from admission to the last byte).

The pace is learned from whole answers only (a stream's end waits on its client's reading), of at least
``MIN_TOKENS`` tokens, and it errs short rather than long: a wait budget cut too far refuses a request that would
have been served, one cut too little only leaves things as they were. Every answer's time has a fixed part
(its prefill, its wait in the engine's own queue), which makes its seconds per token longer than its decoding,
the more so the shorter it is and the longer its prompt: the pace is the lower quartile of the latest answers'
seconds per token, not their median, so a tenant of long prompts and short answers does not cut the budgets of
everyone else.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

MIN_TOKENS = 16  # shorter answers are mostly prefill: their seconds per token say little about decoding
MIN_SAMPLES = 8  # answers needed before the pace is trusted
WINDOW = 64  # the latest answers: the pace follows the engine's load as it changes
PACE_QUANTILE = 0.25  # of the latest answers' seconds per token: see the module docstring


def lower_quartile(values: Iterable[float]) -> float:
    """The :data:`PACE_QUANTILE` of ``values`` (not empty), by rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(PACE_QUANTILE * len(ordered)) - 1)]


class ServicePace:
    """Seconds per output token of the latest whole answers (admission to last byte)."""

    def __init__(self, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        self._per_token: deque[float] = deque(maxlen=window)
        self._tokens: deque[int] = deque(maxlen=window)  # each answer's length, beside its seconds per token
        self.min_samples = min_samples
        self._pace: float | None = None

    def __len__(self) -> int:
        return len(self._per_token)

    def observe(self, output_tokens: int, seconds: float) -> None:
        """An answer of ``output_tokens`` that took ``seconds`` from admission to its end."""
        if output_tokens < MIN_TOKENS or seconds <= 0:
            return
        self._per_token.append(seconds / output_tokens)
        self._tokens.append(output_tokens)
        self._pace = None

    def answer_s_like(self, output_tokens: int) -> float:
        """Seconds an answer of ``output_tokens`` takes at the pace of the latest answers at least a quarter
        as long (a short answer's prefill weighs on its seconds per token: a pace learned from them says a long
        one takes several times what it does); 0 while too few such answers are known. What refusing an answer
        outright rests on, not the pace of all answers."""
        alike = [p for p, n in zip(self._per_token, self._tokens, strict=True) if 4 * n >= output_tokens]
        if len(alike) < self.min_samples:
            return 0.0
        return lower_quartile(alike) * output_tokens

    def seconds_per_token(self) -> float | None:
        """The pace (:data:`PACE_QUANTILE` of the latest answers), or None while too few answers are known."""
        if len(self._per_token) < self.min_samples:
            return None
        if self._pace is None:
            self._pace = lower_quartile(self._per_token)
        return self._pace

    def answer_s(self, output_tokens: int) -> float:
        """Seconds an answer of ``output_tokens`` is expected to take once admitted; 0 while unknown."""
        pace = self.seconds_per_token()
        return 0.0 if pace is None else pace * output_tokens


class FirstEventWait:
    """Seconds from admission to a stream's first event (the engine's prefill and its own queue), of the latest
    streams: what a streamed request under a client's read timeout must keep of it once admitted, since the
    response head waits for that first event. The lower quartile, erring short as the pace does."""

    def __init__(self, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        self._seconds: deque[float] = deque(maxlen=window)
        self.min_samples = min_samples
        self._value: float | None = None

    def observe(self, seconds: float) -> None:
        if seconds < 0:
            return
        self._seconds.append(seconds)
        self._value = None

    def seconds(self) -> float:
        """The expected wait for a first event once admitted; 0 while too few streams are known."""
        if len(self._seconds) < self.min_samples:
            return 0.0
        if self._value is None:
            self._value = lower_quartile(self._seconds)
        return self._value
