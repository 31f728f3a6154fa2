"""Scenario files: who sends what, when, and how the simulator and the gateway are set up for it.

All times in a scenario are *simulated* seconds; the runner divides by nothing and multiplies by the
simulator's ``time_scale`` to get real seconds, so a scenario means the same thing at any speed.

A class says separately what the client sends and what the model does: ``max_tokens`` is the cap in the body
(absent: the client sends none, and the cap is the context's rest), ``output_tokens`` the distribution of
natural lengths (where the model emits EOS; ``gateway.sim.lengths`` syntax). Without ``output_tokens`` the
client sends ``ignore_eos`` and every request runs to its cap, as before.

A class may also say how its clients wait: ``max_wait_s`` (simulated seconds) is sent as the
``x-kvgate-max-wait-s`` header, and ``retry: after-once`` makes a client refused with 429/503 and a
Retry-After come back once, that many seconds later (the retry is a record of its own, ``attempt`` 1).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gateway.sim.cli import build_parser, config_from_args
from gateway.sim.lengths import OutputLengths, parse_lengths


@dataclass(frozen=True)
class Range:
    """An integer drawn uniformly from [min, max] (min == max for a fixed size)."""

    min: int
    max: int

    @classmethod
    def parse(cls, raw: Any) -> Range:
        """``N``, ``{min: A, max: B}``, or the string ``"A-B"``."""
        if isinstance(raw, int):
            return cls(raw, raw)
        if isinstance(raw, str):
            lo, sep, hi = raw.partition("-")
            return cls(int(lo), int(hi if sep else lo))
        return cls(int(raw["min"]), int(raw["max"]))

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.min, self.max)


@dataclass(frozen=True)
class TrafficClass:
    """One kind of request and its arrival process (a burst, or Poisson at a rate)."""

    name: str
    prompt_tokens: Range
    max_tokens: Range | None  # None: the client sends no max_tokens
    api: str = "completions"  # or "chat"
    tenant: str | None = None
    burst_count: int = 0
    burst_at: float = 0.0
    rate: float = 0.0  # requests per simulated second (Poisson)
    start: float = 0.0
    stop: float = 0.0
    output_tokens: OutputLengths | None = None  # natural lengths; None: ignore_eos, run to the cap
    max_wait_s: float | None = None  # sent as x-kvgate-max-wait-s (simulated seconds); None: no header
    retry_once: bool = False  # refused with 429/503 + Retry-After: send again once, after it

    @property
    def weight(self) -> float:
        """Requests this class sends per simulated second over its window (a burst: its count)."""
        return self.rate if self.rate > 0 else float(self.burst_count)


RETRY_POLICIES = {"none": False, "after-once": True}


def parse_retry(raw: Any) -> bool:
    """``retry:`` of a class: absent or ``none``, or ``after-once`` (follow one Retry-After, then give up)."""
    if raw is None:
        return False
    if raw not in RETRY_POLICIES:
        raise ValueError(f"retry: {raw!r} is not one of {', '.join(RETRY_POLICIES)}")
    return RETRY_POLICIES[raw]


@dataclass(frozen=True)
class Arrival:
    """One planned request.

    ``max_tokens`` is the output the response should carry: the cap, or the natural length when the model
    stops first. That is what a served response is checked against (``RequestRecord``) and what the
    in-process bound runs the engine to; what the body says is ``sent_max_tokens``.
    """

    at: float  # simulated seconds from the start of the run
    cls: str
    prompt_tokens: int
    max_tokens: int
    api: str
    tenant: str | None
    output_tokens: int | None = None  # natural length, sent as sim_output_tokens; None: ignore_eos
    cap: int | None = None  # the body's max_tokens; None: ``max_tokens`` itself (or none when ``uncapped``)
    uncapped: bool = False  # the body has no max_tokens
    max_wait_s: float | None = None  # the client's wait budget (simulated s), sent as x-kvgate-max-wait-s
    retry_once: bool = False

    @property
    def sent_max_tokens(self) -> int | None:
        if self.uncapped:
            return None
        return self.cap if self.cap is not None else self.max_tokens


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
    max_model_len: int | None = None  # the simulator's, when a class sends no max_tokens

    def arrivals(self) -> list[Arrival]:
        """The deterministic request plan (seeded), sorted by time.

        Natural lengths come from their own generator, so adding ``output_tokens`` to a class leaves every
        arrival time and prompt of the plan as it was.
        """
        rng = random.Random(self.seed)
        natural_rng = random.Random(f"{self.seed}/output_tokens")
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
                prompt = c.prompt_tokens.draw(rng)
                cap = c.max_tokens.draw(rng) if c.max_tokens is not None else None
                natural = c.output_tokens.draw(natural_rng) if c.output_tokens is not None else None
                out.append(self._arrival(t, c, prompt, cap, natural))
        out.sort(key=lambda a: a.at)
        return out

    def _arrival(self, t: float, c: TrafficClass, prompt: int, cap: int | None, natural: int | None) -> Arrival:
        limit = cap
        if limit is None:
            if self.max_model_len is None:
                raise ValueError(f"class {c.name} sends no max_tokens but the scenario has no max_model_len")
            limit = self.max_model_len - prompt
        owed = limit if natural is None else min(natural, limit)
        return Arrival(
            t,
            c.name,
            prompt,
            owed,
            c.api,
            c.tenant,
            natural,
            cap,
            uncapped=cap is None,
            max_wait_s=c.max_wait_s,
            retry_once=c.retry_once,
        )

    def draw(self, c: TrafficClass, rng: random.Random, natural_rng: random.Random) -> Arrival:
        """One request of class ``c`` at time 0, sized like the plan's (for the closed-loop sweeps)."""
        prompt = c.prompt_tokens.draw(rng)
        cap = c.max_tokens.draw(rng) if c.max_tokens is not None else None
        natural = c.output_tokens.draw(natural_rng) if c.output_tokens is not None else None
        return self._arrival(0.0, c, prompt, cap, natural)

    def draw_mixed(self, rng: random.Random, natural_rng: random.Random) -> Arrival:
        """One request of the scenario's mix: a class picked in proportion to its rate (or burst count)."""
        weights = [c.weight for c in self.classes]
        c = rng.choices(self.classes, weights=weights)[0] if sum(weights) > 0 else self.classes[0]
        return self.draw(c, rng, natural_rng)

    @property
    def natural(self) -> bool:
        """Some class has natural output lengths (the model stops before the cap)."""
        return any(c.output_tokens is not None for c in self.classes)


def load(path: str | Path) -> Scenario:
    raw = yaml.safe_load(Path(path).read_text())
    classes = []
    for c in raw["classes"]:
        arrival = c.get("arrival", {})
        output_tokens = c.get("output_tokens")
        classes.append(
            TrafficClass(
                name=c["name"],
                prompt_tokens=Range.parse(c["prompt_tokens"]),
                max_tokens=None if c.get("max_tokens") is None else Range.parse(c["max_tokens"]),
                output_tokens=None if output_tokens is None else parse_lengths(output_tokens),
                api=c.get("api", "completions"),
                tenant=c.get("tenant"),
                burst_count=int(arrival.get("count", 0)) if arrival.get("kind") == "burst" else 0,
                burst_at=float(arrival.get("at", 0.0)),
                rate=float(arrival.get("rate", 0.0)) if arrival.get("kind") == "poisson" else 0.0,
                start=float(arrival.get("start", 0.0)),
                stop=float(arrival.get("stop", 0.0)),
                max_wait_s=None if c.get("max_wait_s") is None else float(c["max_wait_s"]),
                retry_once=parse_retry(c.get("retry")),
            )
        )
    sim = raw.get("sim", {})
    sim_args = tuple(str(a) for a in sim.get("args", []))
    sweep = raw.get("sweep", {})
    max_model_len = None
    if any(c.max_tokens is None for c in classes):
        max_model_len = config_from_args(build_parser().parse_args(list(sim_args))).max_model_len
    return Scenario(
        name=raw["name"],
        description=raw.get("description", ""),
        classes=tuple(classes),
        sim_args=sim_args,
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
        max_model_len=max_model_len,
    )
