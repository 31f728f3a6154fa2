"""Scenario files: who sends what, when, and how the simulator and the gateway are set up for it.

All times in a scenario are *simulated* seconds; the runner divides by nothing and multiplies by the
simulator's ``time_scale`` to get real seconds, so a scenario means the same thing at any speed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Range:
    """An integer drawn uniformly from [min, max] (min == max for a fixed size)."""

    min: int
    max: int

    @classmethod
    def parse(cls, raw: Any) -> Range:
        if isinstance(raw, int):
            return cls(raw, raw)
        return cls(int(raw["min"]), int(raw["max"]))

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.min, self.max)


@dataclass(frozen=True)
class TrafficClass:
    """One kind of request and its arrival process (a burst, or Poisson at a rate)."""

    name: str
    prompt_tokens: Range
    max_tokens: Range
    api: str = "completions"  # or "chat"
    tenant: str | None = None
    burst_count: int = 0
    burst_at: float = 0.0
    rate: float = 0.0  # requests per simulated second (Poisson)
    start: float = 0.0
    stop: float = 0.0


@dataclass(frozen=True)
class Arrival:
    """One planned request."""

    at: float  # simulated seconds from the start of the run
    cls: str
    prompt_tokens: int
    max_tokens: int
    api: str
    tenant: str | None


@dataclass(frozen=True)
class SweepConfig:
    """How the concurrency sweep measures each level (simulated seconds; see loadtests/sweep.py)."""

    duration_s: float = 60.0  # clients send new requests until then
    warmup_s: float = 20.0  # the measured window starts here
    stagger_s: float = 0.0  # client i starts at stagger_s * i / concurrency
    blocks: int = 4  # the window is cut into this many parts to show its spread
    repeats: int = 1


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    classes: tuple[TrafficClass, ...]
    sim_args: tuple[str, ...]
    time_scale: float
    ttft_slo_s: float
    gateway: dict[str, Any] = field(default_factory=dict)
    vllm_queue_max: int | None = None
    seed: int = 0
    sweep_concurrency: tuple[int, ...] = ()
    sweep: SweepConfig = field(default_factory=SweepConfig)

    def arrivals(self) -> list[Arrival]:
        """The deterministic request plan (seeded), sorted by time."""
        rng = random.Random(self.seed)
        out: list[Arrival] = []
        for c in self.classes:
            times: list[float] = [c.burst_at] * c.burst_count
            if c.rate > 0:
                t = c.start
                while True:
                    t += rng.expovariate(c.rate)
                    if t >= c.stop:
                        break
                    times.append(t)
            for t in times:
                out.append(Arrival(t, c.name, c.prompt_tokens.draw(rng), c.max_tokens.draw(rng), c.api, c.tenant))
        out.sort(key=lambda a: a.at)
        return out


def load(path: str | Path) -> Scenario:
    raw = yaml.safe_load(Path(path).read_text())
    classes = []
    for c in raw["classes"]:
        arrival = c.get("arrival", {})
        classes.append(
            TrafficClass(
                name=c["name"],
                prompt_tokens=Range.parse(c["prompt_tokens"]),
                max_tokens=Range.parse(c["max_tokens"]),
                api=c.get("api", "completions"),
                tenant=c.get("tenant"),
                burst_count=int(arrival.get("count", 0)) if arrival.get("kind") == "burst" else 0,
                burst_at=float(arrival.get("at", 0.0)),
                rate=float(arrival.get("rate", 0.0)) if arrival.get("kind") == "poisson" else 0.0,
                start=float(arrival.get("start", 0.0)),
                stop=float(arrival.get("stop", 0.0)),
            )
        )
    sim = raw.get("sim", {})
    sweep = raw.get("sweep", {})
    return Scenario(
        name=raw["name"],
        description=raw.get("description", ""),
        classes=tuple(classes),
        sim_args=tuple(str(a) for a in sim.get("args", [])),
        time_scale=float(sim.get("time_scale", 1.0)),
        ttft_slo_s=float(raw.get("ttft_slo_s", 10.0)),
        gateway=raw.get("gateway", {}),
        vllm_queue_max=raw.get("vllm_queue", {}).get("max_num_queued_reqs"),
        seed=int(raw.get("seed", 0)),
        sweep_concurrency=tuple(int(x) for x in sweep.get("concurrency", ())),
        sweep=SweepConfig(
            duration_s=float(sweep.get("duration_s", 60.0)),
            warmup_s=float(sweep.get("warmup_s", 20.0)),
            stagger_s=float(sweep.get("stagger_s", 0.0)),
            blocks=int(sweep.get("blocks", 4)),
            repeats=int(sweep.get("repeats", 1)),
        ),
    )
