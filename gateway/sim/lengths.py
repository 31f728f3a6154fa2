"""Natural output lengths: how many tokens a model writes before it emits EOS, as a distribution.

Real chat models stop long before their ``max_tokens`` (a few hundred tokens against caps of thousands), so
admission that reserves by expected output can only be judged on a simulator whose requests stop. The same
spec syntax serves ``kvgate sim --output-tokens`` and a scenario's ``output_tokens`` key:

* ``N`` or ``fixed:N`` -- always N tokens;
* ``A-B`` or ``uniform:A-B`` -- an integer uniform on [A, B];
* ``lognormal:median=M,p99=P`` -- lognormal with that median and 99th percentile (P > M), rounded, >= 1.

Pure: a draw takes the caller's ``random.Random``, so reproducibility is the caller's seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist

Z99 = NormalDist().inv_cdf(0.99)  # 2.3263...: p99 of a lognormal is exp(mu + Z99 * sigma)


@dataclass(frozen=True)
class Fixed:
    n: int

    def draw(self, rng: random.Random) -> int:
        return self.n

    def __str__(self) -> str:
        return f"fixed:{self.n}"


@dataclass(frozen=True)
class Uniform:
    lo: int
    hi: int

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return f"uniform:{self.lo}-{self.hi}"


@dataclass(frozen=True)
class LogNormal:
    """Parametrised by what is observed in traces (median and tail) rather than by mu and sigma."""

    median: float
    p99: float

    @property
    def mu(self) -> float:
        return math.log(self.median)

    @property
    def sigma(self) -> float:
        return math.log(self.p99 / self.median) / Z99

    def draw(self, rng: random.Random) -> int:
        return max(1, round(rng.lognormvariate(self.mu, self.sigma)))

    def __str__(self) -> str:
        return f"lognormal:median={self.median:g},p99={self.p99:g}"


OutputLengths = Fixed | Uniform | LogNormal


def parse_lengths(spec: str | int) -> OutputLengths:
    """Parse a spec (see the module docstring); ``ValueError`` with the accepted syntax otherwise."""
    if isinstance(spec, bool):
        raise ValueError(f"bad output length spec {spec!r}")
    if isinstance(spec, int):
        return _fixed(spec)
    text = spec.strip()
    kind, sep, rest = text.partition(":")
    if not sep:
        kind, rest = ("uniform", text) if "-" in text else ("fixed", text)
    kind = kind.strip().lower()
    try:
        if kind == "fixed":
            return _fixed(int(rest))
        if kind == "uniform":
            lo, hi = (int(x) for x in rest.split("-"))
            if not 1 <= lo <= hi:
                raise ValueError("need 1 <= A <= B")
            return Uniform(lo, hi)
        if kind == "lognormal":
            params = dict(kv.split("=", 1) for kv in rest.split(","))
            if set(params) != {"median", "p99"}:
                raise ValueError("need exactly median= and p99=")
            median, p99 = float(params["median"]), float(params["p99"])
            if not 1 <= median < p99:
                raise ValueError("need 1 <= median < p99")
            return LogNormal(median, p99)
    except ValueError as exc:
        raise ValueError(f"bad output length spec {spec!r}: {exc}; {SYNTAX}") from None
    raise ValueError(f"bad output length spec {spec!r}; {SYNTAX}")


SYNTAX = "use N, fixed:N, A-B, uniform:A-B or lognormal:median=M,p99=P"


def _fixed(n: int) -> Fixed:
    if n < 1:
        raise ValueError(f"a fixed output length must be >= 1, got {n}")
    return Fixed(n)
