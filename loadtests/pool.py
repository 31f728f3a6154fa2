"""Pools of engines: one scenario against ``N`` simulated engines, in three layouts (arms), fresh processes each:

* ``direct-rr``: the load generator round-robins requests straight over the ``N`` engines (no admission);
* ``sidecar``: each engine has its own ``kvgate serve`` in front of it, and the load generator round-robins
  over the ``N`` gateways: today's layout behind a blind Kubernetes Service;
* ``pool-kvgate``: one ``kvgate serve --upstream E1 --upstream E2 ...`` in front of all ``N``: one queue for
  the pool, each request placed on the engine with the most headroom left after it.

Request ``i`` of the plan goes to target ``i mod N`` in the round-robin arms. A separate sampler process
scrapes every engine's ``/metrics`` and every gateway's (kvgate's per-engine series, labelled by the engine's
URL) at 20 Hz. A scenario may kill one engine's process (SIGKILL, as a crash) at a planned time and start it
again on the same port some seconds later (``pool.fault``). Every request has a deadline
(``pool.request_deadline_s`` after it was sent): one still open then is cut and counted as ``hung``.

The simulators each keep their own virtual clock (they lag the time scale independently on a loaded machine).
Client-side times and every sample are re-timed on the *mean* of the engines' clocks (the killed engine's clock
starts again from zero with its new process, so it is left out), see :func:`pool_clock`; the spread of the
engines' lags is in each summary.

The scenario file is an ordinary one (``loadtests/scenario.py``) with a ``pool:`` block:

    pool:
      engines: 4
      engine_args: [[], [], [], [--num-gpu-blocks-override, "15872"]]   # optional, per engine
      arms: [direct-rr, sidecar, pool-kvgate]
      single_engine_sweep: burst-8b-h100   # the saved sweep that gives one engine's best stable throughput
      fault: {engine: 0, kill_at: 8, down_s: 8}                          # optional; simulated seconds
      request_deadline_s: 300
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from loadtests import compare, runner
from loadtests.scenario import Arrival, Scenario
from loadtests.scenario import load as load_scenario
from loadtests.stats import (
    RETRYABLE,
    RequestRecord,
    Sample,
    counter_increase,
    engine_clock,
    retime_records,
    summarize,
    time_fraction,
)
from tests.support.procs import Proc, free_port, start_gateway
from tests.support.sampler import Sampler

POOL_ARMS = ("direct-rr", "sidecar", "pool-kvgate")
GATEWAY_ARMS = ("sidecar", "pool-kvgate")
HUNG = "hung"
CHECKS = ("burst", "overload", "hetero", "fault", "none")

# What is sampled: (column, metric, labels). Engine columns are the runner's backend series.
ENGINE_COLUMNS = [(name, name, ()) for name in sorted(runner.BACKEND_SERIES)]
GATEWAY_SERIES = (
    ("kv", "kvgate_engine_kv_usage_observed"),
    ("projected", "kvgate_engine_kv_usage_projected"),
    ("reserved", "kvgate_engine_reserved_blocks"),
    ("inflight", "kvgate_engine_inflight_requests"),
    ("placements", "kvgate_engine_placements_total"),
    ("ejected", "kvgate_engine_ejected"),
    ("ejections", "kvgate_engine_ejections_total"),
    ("restarts", "kvgate_engine_restarts_total"),
)
GATEWAY_POOL_COLUMNS = [
    ("queue", "kvgate_queue_depth", ()),
    ("pool_placeable", "kvgate_pool_engines", (("state", "placeable"),)),
    ("pool_ejected", "kvgate_pool_engines", (("state", "ejected"),)),
]


# --- the scenario's pool block ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    engine: int
    kill_at: float  # simulated seconds after the first planned send
    down_s: float  # simulated seconds between the kill and the new process's start


@dataclass(frozen=True)
class PoolSpec:
    engines: int
    engine_args: tuple[tuple[str, ...], ...] = ()
    arms: tuple[str, ...] = POOL_ARMS
    single_engine_sweep: str | None = None
    fault: Fault | None = None
    request_deadline_s: float = 600.0
    checks: str = "none"  # which claims the report checks: burst, overload, hetero, fault (loadtests/pool_report.py)

    def engine_args_of(self, i: int) -> list[str]:
        """Engine ``i``'s own simulator flags (on top of the scenario's)."""
        return list(self.engine_args[i]) if i < len(self.engine_args) else []

    def args_of(self, sc: Scenario, i: int) -> list[str]:
        """Engine ``i``'s simulator flags: the scenario's, its own extras, the time scale, OOM mode restart."""
        return [*sc.sim_args, *self.engine_args_of(i), "--time-scale", str(sc.time_scale), "--oom-mode", "restart"]


def parse_spec(raw: dict[str, Any]) -> PoolSpec:
    fault = raw.get("fault")
    arms = tuple(raw.get("arms", POOL_ARMS))
    unknown = set(arms) - set(POOL_ARMS)
    if unknown:
        raise ValueError(f"unknown pool arms {sorted(unknown)}; known: {', '.join(POOL_ARMS)}")
    checks = str(raw.get("checks", "fault" if fault is not None else "none"))
    if checks not in CHECKS:
        raise ValueError(f"pool checks {checks!r} is not one of {', '.join(CHECKS)}")
    if checks == "fault" and fault is None:
        raise ValueError("pool checks: fault needs a fault: block")
    engines = int(raw["engines"])
    engine_args = tuple(tuple(str(a) for a in args) for args in raw.get("engine_args", []))
    if len(engine_args) > engines:
        raise ValueError(f"engine_args for {len(engine_args)} engines in a pool of {engines}")
    return PoolSpec(
        engines=engines,
        engine_args=engine_args,
        arms=arms,
        single_engine_sweep=raw.get("single_engine_sweep"),
        fault=None if fault is None else Fault(int(fault["engine"]), float(fault["kill_at"]), float(fault["down_s"])),
        request_deadline_s=float(raw.get("request_deadline_s", 600.0)),
        checks=checks,
    )


def load(path: str | Path) -> tuple[Scenario, PoolSpec]:
    raw = yaml.safe_load(Path(path).read_text())
    if "pool" not in raw:
        raise ValueError(f"{path} has no pool: block")
    return load_scenario(path), parse_spec(raw["pool"])


# --- processes --------------------------------------------------------------------------------------------


def engine_proc(args: Sequence[str], port: int, log_path: Path) -> Proc:
    """A simulator on a port of our choosing, so that it can be started again on the same one."""
    argv = [sys.executable, "-m", "gateway.sim", "--host", "127.0.0.1", "--port", str(port), *args]
    return Proc("sim", argv, url=f"http://127.0.0.1:{port}", log_path=log_path)


@dataclass
class Topology:
    engines: list[Proc]
    gateways: list[Proc]
    targets: list[str]  # where clients send: request i goes to targets[i % len(targets)]
    engine_logs: list[list[Path]]  # every incarnation's log, per engine


@contextlib.contextmanager
def topology(sc: Scenario, spec: PoolSpec, arm: str, out: Path) -> Iterator[Topology]:
    if arm not in POOL_ARMS:
        raise ValueError(f"unknown arm {arm}; known: {', '.join(POOL_ARMS)}")
    with contextlib.ExitStack() as stack:
        engines = []
        for i in range(spec.engines):
            proc = engine_proc(spec.args_of(sc, i), free_port(), out / f"sim-e{i}.log")
            stack.callback(proc.stop)
            engines.append(proc.start())
        for proc in engines:  # started together, waited for together
            proc.wait_ready("/health", 60.0)
        gateways: list[Proc] = []
        if arm == "pool-kvgate":
            cfg_path = out / "kvgate.yaml"
            cfg_path.write_text(yaml.safe_dump(compare.gateway_config(sc, engines[0].url), sort_keys=False))
            extra = [a for e in engines[1:] for a in ("--upstream", e.url)]
            gw = start_gateway(
                engines[0].url, cfg_path, tokenizer="heuristic", extra_args=extra, log_path=out / "kvgate.log"
            )
            stack.callback(gw.stop)
            gateways.append(gw)
        elif arm == "sidecar":
            for i, e in enumerate(engines):
                cfg_path = out / f"kvgate-e{i}.yaml"
                cfg_path.write_text(yaml.safe_dump(compare.gateway_config(sc, e.url), sort_keys=False))
                gw = start_gateway(e.url, cfg_path, tokenizer="heuristic", log_path=out / f"kvgate-e{i}.log")
                stack.callback(gw.stop)
                gateways.append(gw)
        targets = [g.url for g in gateways] if gateways else [e.url for e in engines]
        yield Topology(engines, gateways, targets, [[e.log_path] for e in engines])


# --- sampling ---------------------------------------------------------------------------------------------

Column = tuple[str, str, tuple[tuple[str, str], ...]]


def gateway_columns(engine_urls: Sequence[str]) -> list[Column]:
    cols = list(GATEWAY_POOL_COLUMNS)
    for i, url in enumerate(engine_urls):
        cols += [(f"{key}@e{i}", name, (("engine", url),)) for key, name in GATEWAY_SERIES]
    return cols


async def _read_columns(session: aiohttp.ClientSession, url: str, cols: Sequence[Column]) -> dict[str, float] | None:
    """One scrape: the value of each column (a metric summed over the samples carrying its labels), or None."""
    from tests.support.promtext import metric_sum, parse_metrics
    from tests.support.sampler import TIMEOUT_S

    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as response:
            if response.status == 200:
                series = parse_metrics(await response.text(), {name for _, name, _ in cols})
                return {col: metric_sum(series, name, default=math.nan, **dict(labels)) for col, name, labels in cols}
    except (TimeoutError, aiohttp.ClientError):
        pass
    return None


def _columns_main(targets: Any, hz: float, ready: Any, stop: Any, results: Any) -> None:
    """The sampler process, reading labelled columns instead of plain sums (the shared sampler's loop)."""
    from tests.support import sampler

    sampler._read = _read_columns  # type: ignore[assignment]
    sampler._main(targets, hz, ready, stop, results)


class ColumnSampler(Sampler):
    """``tests.support.sampler.Sampler`` (its process, schedule and timeouts), each target read as columns."""

    def __init__(self, targets: Sequence[tuple[str, Sequence[Column]]], hz: float = runner.SAMPLE_HZ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._ready = ctx.Event()
        self._stop = ctx.Event()
        self._results: Any = ctx.Queue()
        wanted = [(url, list(cols)) for url, cols in targets]
        self._proc = ctx.Process(
            target=_columns_main, args=(wanted, hz, self._ready, self._stop, self._results), daemon=True
        )


@dataclass
class GatewaySample:
    t: float
    up: bool
    values: dict[str, float] = field(default_factory=dict)

    def get(self, key: str) -> float:
        return self.values.get(key, math.nan)


# --- a run ------------------------------------------------------------------------------------------------


@dataclass
class Events:
    """What the harness did to the pool, on the run's clock (simulated seconds)."""

    kill_at: float | None = None
    restart_at: float | None = None  # the new process was started
    ready_at: float | None = None  # and answered /health


async def _fault(top: Topology, fault: Fault, clock: runner.Clock, offset: float, out: Path, ev: Events) -> None:
    proc = top.engines[fault.engine]
    await clock.sleep_until(offset + fault.kill_at)
    ev.kill_at = clock.now()
    proc.signal(signal.SIGKILL)
    await asyncio.to_thread(lambda: proc.popen.wait(10) if proc.popen is not None else None)
    await clock.sleep_until(offset + fault.kill_at + fault.down_s)
    proc.log_path = out / f"sim-e{fault.engine}.restart.log"
    top.engine_logs[fault.engine].append(proc.log_path)
    ev.restart_at = clock.now()
    await asyncio.to_thread(lambda: proc.start().wait_ready("/health", 60.0))
    ev.ready_at = clock.now()


async def run(
    arrivals: Sequence[Arrival],
    top: Topology,
    *,
    model: str,
    time_scale: float,
    request_deadline_s: float,
    fault: Fault | None = None,
    out: Path | None = None,
) -> tuple[list[RequestRecord], list[int], list[list[Sample]], list[list[GatewaySample]], Events]:
    """Open loop over the topology's targets (round robin); the records, each request's target, the engines' and
    the gateways' samples (on the harness clock) and the fault's times."""
    urls = [e.url for e in top.engines]
    engine_targets = [(u, ENGINE_COLUMNS) for u in urls]
    if not top.gateways:
        gateway_targets = []
    elif len(top.gateways) == 1:
        gateway_targets = [(top.gateways[0].url, gateway_columns(urls))]
    else:
        gateway_targets = [(g.url, gateway_columns([u])) for g, u in zip(top.gateways, urls, strict=True)]
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    events = Events()
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        clock = runner.Clock(time_scale)
        sampler = ColumnSampler([*engine_targets, *gateway_targets])
        await asyncio.to_thread(sampler.start)
        bodies = [orjson.dumps(runner.request_body(a, model, i)) for i, a in enumerate(arrivals)]
        routes = [i % len(top.targets) for i in range(len(arrivals))]
        await asyncio.sleep(0.2)
        offset = clock.now()

        async def planned(i: int, a: Arrival) -> list[RequestRecord]:
            await clock.sleep_until(offset + a.at)
            sent = clock.now()
            try:
                return await asyncio.wait_for(
                    runner.send_with_retry(session, top.targets[routes[i]], a, i, model, clock, {}, bodies[i]),
                    request_deadline_s * time_scale,
                )
            except TimeoutError:
                rec = RequestRecord(i, a.cls, a.tenant, sent, a.prompt_tokens, a.max_tokens, error_code=HUNG)
                return [rec]

        chaos = (
            asyncio.create_task(_fault(top, fault, clock, offset, out or Path("."), events))
            if fault is not None
            else None
        )
        attempts = await asyncio.gather(*(planned(i, a) for i, a in enumerate(arrivals)))
        if chaos is not None:
            await chaos
        records = [rec for recs in attempts for rec in recs]
        await asyncio.sleep(0.3)
        readings = await asyncio.to_thread(sampler.stop)
    at = clock.at
    n = len(urls)
    engines = [[_engine_sample(at(t), v) for t, v in readings[i]] for i in range(n)]
    gateways = [[GatewaySample(at(t), v is not None, v or {}) for t, v in r] for r in readings[n:]]
    return records, [routes[r.rid] for r in records], engines, gateways, events


def _engine_sample(t: float, v: dict[str, float] | None) -> Sample:
    return runner._backend_sample(t, v)


# --- one clock for the pool -------------------------------------------------------------------------------


def pool_clock(engines: Sequence[Sequence[Sample]], exclude: Sequence[int] = ()) -> Callable[[float], float]:
    """The mean of the engines' clocks (each aligned at its first sample), leaving out ``exclude`` (an engine
    whose process was restarted: its clock began again at zero). The identity when no engine has a clock."""
    maps = [m for i, s in enumerate(engines) if i not in exclude and (m := engine_clock(s)) is not None]
    if not maps:
        return lambda t: t
    return lambda t: sum(m(t) for m in maps) / len(maps)


def retime(
    f: Callable[[float], float],
    records: Sequence[RequestRecord],
    engines: Sequence[Sequence[Sample]],
    gateways: Sequence[Sequence[GatewaySample]],
    events: Events,
) -> tuple[list[RequestRecord], list[list[Sample]], list[list[GatewaySample]], Events]:
    new_records = retime_records(f, records)
    new_engines = [[dataclasses.replace(s, t=f(s.t)) for s in e] for e in engines]
    new_gateways = [[dataclasses.replace(s, t=f(s.t)) for s in g] for g in gateways]
    new_events = Events(*(None if v is None else f(v) for v in (events.kill_at, events.restart_at, events.ready_at)))
    return new_records, new_engines, new_gateways, new_events


# --- summaries --------------------------------------------------------------------------------------------


@dataclass
class PoolResult:
    arm: str
    records: list[RequestRecord]
    routes: list[int]  # target index of each record (round robin; 0 for pool-kvgate)
    engines: list[list[Sample]]
    gateways: list[list[GatewaySample]]
    events: Events
    summary: dict[str, Any]

    def gateway_series(self, engine: int, key: str) -> list[tuple[float, float]]:
        """One per-engine kvgate series, ``(t, value)``, from the gateway that books that engine."""
        g = self.gateways[0] if len(self.gateways) == 1 else self.gateways[engine] if self.gateways else []
        col = f"{key}@e{engine}" if len(self.gateways) == 1 else f"{key}@e0"
        return [(s.t, s.get(col)) for s in g if s.up and not math.isnan(s.get(col))]


def demand_queued(
    engines: Sequence[Sequence[Sample]], gateways: Sequence[Sequence[GatewaySample]], engine_waiting: bool = False
) -> list[float]:
    """Times at which requests waited to be placed: a gateway's queue non-empty; without gateways (direct-rr), or
    with ``engine_waiting`` (as ``stats.saturated_throughput`` counts for one engine), an engine's waiting queue
    non-empty too. Behind kvgate an engine's own waiting queue holds only the prefills it is about to schedule:
    it is non-empty for moments from the first arrivals on, while the engines are still filling."""
    times = [s.t for g in gateways for s in g if s.up and s.get("queue") > 0]
    if engine_waiting or not gateways:
        times += [s.t for e in engines for s in e if s.up and not math.isnan(s.waiting) and s.waiting > 0]
    return sorted(times)


def pool_saturated_throughput(
    engines: Sequence[Sequence[Sample]], gateways: Sequence[Sequence[GatewaySample]], engine_waiting: bool = False
) -> tuple[float, float]:
    """The pool's output tok/s (every engine's generation counter, reset-aware) from the first to the last
    moment some request waited to be placed (:func:`demand_queued`), and that span."""
    busy = demand_queued(engines, gateways, engine_waiting)
    if len(busy) < 2 or busy[-1] <= busy[0]:
        return math.nan, 0.0
    t0, t1 = busy[0], busy[-1]
    tokens = sum(counter_increase([s.generation_tokens for s in e if s.up and t0 <= s.t <= t1]) for e in engines)
    return tokens / (t1 - t0), t1 - t0


def engine_summary(samples: Sequence[Sample], ooms: int) -> dict[str, Any]:
    up = [s for s in samples if s.up]
    above_s, _ = time_fraction(samples, 0.90 + 1e-12, math.inf)
    _, band_frac = time_fraction(samples, 0.80, 0.90)
    return {
        "oom_crashes": ooms,
        "preemptions": counter_increase([s.preemptions for s in samples]),
        "peak_kv_usage": max((s.kv for s in up if not math.isnan(s.kv)), default=math.nan),
        "time_above_90_s": above_s,
        "time_in_80_90_frac": band_frac,
        "output_tokens": counter_increase([s.generation_tokens for s in up]),
        "mean_running": _mean([s.running for s in up]),
        "down_s": sum(b.t - a.t for a, b in itertools.pairwise(samples) if not a.up),
        "sim_lag_real_s": max((s.lag for s in samples if not math.isnan(s.lag)), default=math.nan),
        "samples": len(samples),
    }


def _mean(values: Sequence[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def summarize_pool(
    arm: str,
    records: Sequence[RequestRecord],
    routes: Sequence[int],
    engines: Sequence[Sequence[Sample]],
    gateways: Sequence[Sequence[GatewaySample]],
    ooms: Sequence[int],
    ttft_slo_s: float,
    real_stamps: Sequence[Sequence[float]],
) -> dict[str, Any]:
    s = summarize(records, [], ttft_slo_s, sum(ooms))
    per_engine = [engine_summary(e, o) for e, o in zip(engines, ooms, strict=True)]
    for i, pe in enumerate(per_engine):
        if arm == "pool-kvgate":
            pl = [v for t, v in _series(gateways[0], f"placements@e{i}")]
            pe["placements"] = max(pl, default=math.nan)
        elif arm == "sidecar":
            pl = [v for t, v in _series(gateways[i], "placements@e0")]
            pe["placements"] = max(pl, default=math.nan)
        else:
            pe["placements"] = float(sum(1 for r in routes if r == i))
        pe["requests_routed"] = sum(1 for r in routes if r == i) if arm != "pool-kvgate" else None
    sat, span = pool_saturated_throughput(engines, gateways)
    gaps = [max((b - a for a, b in itertools.pairwise(ts)), default=math.nan) for ts in real_stamps]
    rates = [(len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else math.nan for ts in real_stamps]
    s.update(
        {
            "arm": arm,
            "engines": per_engine,
            "preemptions": sum(pe["preemptions"] for pe in per_engine),
            "peak_kv_usage": max((pe["peak_kv_usage"] for pe in per_engine), default=math.nan),
            "peak_kv_usage_per_engine": [pe["peak_kv_usage"] for pe in per_engine],
            "time_above_90_s": max((pe["time_above_90_s"] for pe in per_engine), default=math.nan),
            "saturated_tok_per_s": sat,
            "saturated_window_s": span,
            "refusals": sum(1 for r in records if r.status in RETRYABLE),
            "failed": sum(1 for r in records if not r.ok and r.status not in RETRYABLE),
            "hung": sum(1 for r in records if r.error_code == HUNG),
            "unfinished": sum(1 for r in records if r.finished is None),
            "backend_down_s": sum(pe["down_s"] for pe in per_engine),
            "sim_lag_real_s": max((pe["sim_lag_real_s"] for pe in per_engine), default=math.nan),
            "sim_lag_real_s_per_engine": [pe["sim_lag_real_s"] for pe in per_engine],
            "sample_hz_real": min(rates, default=math.nan),
            "sample_max_gap_real_s": max(gaps, default=math.nan),
        }
    )
    s.pop("mean_running", None)
    return s


def _series(g: Sequence[GatewaySample], col: str) -> list[tuple[float, float]]:
    return [(s.t, s.get(col)) for s in g if s.up and not math.isnan(s.get(col))]


# --- an arm, saved and read back --------------------------------------------------------------------------


def revision() -> str:
    """The commit the gateway runs from, and whether gateway/ had uncommitted changes (read-only git calls)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "gateway"], cwd=root).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" + uncommitted changes in gateway/" if dirty else "")


def run_arm(sc: Scenario, spec: PoolSpec, arm: str, out_dir: Path) -> PoolResult:
    out = out_dir / arm
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    rev = revision()
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("sim-e*.restart.log"):
        stale.unlink()
    fault = spec.fault if arm == "pool-kvgate" else None
    with topology(sc, spec, arm, out) as top:
        records, routes, engines, gateways, events = asyncio.run(
            run(
                sc.arrivals(),
                top,
                model=compare.model_name(sc),
                time_scale=sc.time_scale,
                request_deadline_s=spec.request_deadline_s,
                fault=fault,
                out=out,
            )
        )
    ooms = [sum(len(compare.OOM_LINE.findall(p.read_text(errors="replace"))) for p in logs) for logs in top.engine_logs]
    real = [[s.t * sc.time_scale for s in e] for e in engines] + [[s.t * sc.time_scale for s in g] for g in gateways]
    f = pool_clock(engines, exclude=(fault.engine,) if fault else ())
    records, engines, gateways, events = retime(f, records, engines, gateways, events)
    summary = summarize_pool(arm, records, routes, engines, gateways, ooms, sc.ttft_slo_s, real)
    summary["events"] = asdict(events)
    summary["time_scale"] = sc.time_scale
    summary["revision"] = rev
    summary["started"] = started
    summary["load_average"] = os.getloadavg()[0]
    res = PoolResult(arm, records, routes, engines, gateways, events, summary)
    save(out, res)
    return res


def save(out: Path, res: PoolResult) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "requests.jsonl", "w") as f:
        for r, route in zip(res.records, res.routes, strict=True):
            f.write(json.dumps({**asdict(r), "target": route}) + "\n")
    for i, samples in enumerate(res.engines):
        _write_csv(
            out / f"samples-e{i}.csv", [asdict(s) for s in samples], [f.name for f in dataclasses.fields(Sample)]
        )
    for j, g in enumerate(res.gateways):
        cols = sorted({k for s in g for k in s.values})
        rows = [{"t": s.t, "up": s.up, **s.values} for s in g]
        _write_csv(out / f"gateway-{j}.csv", rows, ["t", "up", *cols])
    (out / "summary.json").write_text(json.dumps(res.summary, indent=2, default=str) + "\n")


def _write_csv(path: Path, rows: Sequence[dict[str, Any]], cols: Sequence[str]) -> None:
    with open(path, "w") as f:
        f.write(",".join(cols) + "\n")
        for row in rows:
            f.write(",".join(_cell(row.get(c, math.nan)) for c in cols) + "\n")


def _cell(v: Any) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return f"{v:.4f}" if not math.isnan(v) else "nan"
    return str(v)


def _read_csv(path: Path) -> list[dict[str, float]]:
    lines = path.read_text().splitlines()
    names = lines[0].split(",")
    return [{k: float(v) for k, v in zip(names, line.split(","), strict=True)} for line in lines[1:]]


def load_arm(out_dir: Path, arm: str) -> PoolResult:
    out = out_dir / arm
    fields = {f.name for f in dataclasses.fields(RequestRecord)}
    records, routes = [], []
    for line in (out / "requests.jsonl").read_text().splitlines():
        row = json.loads(line)
        routes.append(int(row.get("target", 0)))
        records.append(RequestRecord(**{k: v for k, v in row.items() if k in fields}))
    summary = json.loads((out / "summary.json").read_text())
    engines = []
    for i in range(len(summary["engines"])):
        rows = _read_csv(out / f"samples-e{i}.csv")
        engines.append([Sample(row.pop("t"), bool(row.pop("up")), **row) for row in rows])
    gateways = []
    for path in sorted(out.glob("gateway-*.csv"), key=lambda p: int(p.stem.split("-")[1])):
        gateways.append(
            [
                GatewaySample(row["t"], bool(row["up"]), {k: v for k, v in row.items() if k not in ("t", "up")})
                for row in _read_csv(path)
            ]
        )
    events = Events(**summary.get("events", {}))
    # derived from the samples: recomputed, so that a changed definition applies to saved runs too
    summary["saturated_tok_per_s"], summary["saturated_window_s"] = pool_saturated_throughput(engines, gateways)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return PoolResult(arm, records, routes, engines, gateways, events, summary)


def compare_pool(
    sc: Scenario, spec: PoolSpec, out_dir: Path, arms: Sequence[str] | None = None, reuse: bool = False
) -> list[PoolResult]:
    """Run every arm of the pool scenario, one after another (``reuse``: read back the arms already saved)."""
    results = []
    for arm in arms or spec.arms:
        if reuse and (out_dir / arm / "summary.json").exists():
            results.append(load_arm(out_dir, arm))
        else:
            print(f"  pool arm {arm} ({time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.1f})", flush=True)
            results.append(run_arm(sc, spec, arm, out_dir))
    (out_dir / "compare.json").write_text(json.dumps([r.summary for r in results], indent=2, default=str) + "\n")
    return results
