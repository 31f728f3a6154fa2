"""Report pieces for pools of engines (``loadtests/pool.py``): tables, per-engine plots, the reference
throughput of one engine, and the checks written as PASS/FAIL lines."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from gateway.sim.config import SimConfig
from loadtests import pool_bound
from loadtests.bound import closed_loop_capacity
from loadtests.pool import PoolResult, PoolSpec, compare_pool, pool_saturated_throughput
from loadtests.pool import load as load_pool
from loadtests.report import fmt
from loadtests.scenario import Scenario
from loadtests.stats import throughput_series

BAND = 0.90
THROUGHPUT_FRAC = 0.90
DEAD_GRACE_S = 1.0  # simulated seconds after the kill before the killed engine's ledger must read 0

ROWS: list[tuple[str, str]] = [
    ("OOM crashes (all engines)", "oom_crashes"),
    ("preemptions (all engines)", "preemptions"),
    ("peak KV usage (sampled, highest engine)", "peak_kv_usage"),
    ("time KV > 90% (s, worst engine)", "time_above_90_s"),
    ("requests served / sent", "served"),
    ("refused (429/503)", "refusals"),
    ("failed (errors, truncated)", "failed"),
    ("hung (open at the deadline)", "hung"),
    ("goodput (served with TTFT ≤ SLO)", "goodput"),
    ("output token throughput, whole run (tok/s)", "output_tok_per_s"),
    ("output token throughput while demand queued (tok/s)", "saturated_tok_per_s"),
    ("makespan (s)", "makespan_s"),
    ("TTFT p50 (s)", "ttft_p50_s"),
    ("TTFT p99 (s)", "ttft_p99_s"),
    ("every 429/503 has Retry-After", "rejections_with_retry_after"),
    ("engines down (s, summed)", "backend_down_s"),
    ("/metrics samples per real second (slowest target)", "sample_hz_real"),
    ("longest gap between samples (real s)", "sample_max_gap_real_s"),
    ("simulator lag behind its time scale (real s, worst engine)", "sim_lag_real_s"),
]
ENGINE_ROWS: list[tuple[str, str]] = [
    ("OOM crashes", "oom_crashes"),
    ("preemptions", "preemptions"),
    ("peak KV usage (sampled)", "peak_kv_usage"),
    ("time KV > 90% (s)", "time_above_90_s"),
    ("time KV in 80–90% (fraction)", "time_in_80_90_frac"),
    ("output tokens generated", "output_tokens"),
    ("placements (kvgate) / requests sent (direct-rr)", "placements"),
    ("down (s)", "down_s"),
    ("simulator lag (real s)", "sim_lag_real_s"),
]


def _check(ok: bool, text: str) -> str:
    return f"- **{'PASS' if ok else 'FAIL'}**: {text}"


def _f(v: float, digits: int = 3) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


# --- tables -----------------------------------------------------------------------------------------------


def table(results: Sequence[PoolResult]) -> str:
    lines = ["| metric | " + " | ".join(r.arm for r in results) + " |", "| --- |" + " --- |" * len(results)]
    for label, key in ROWS:
        lines.append(f"| {label} | " + " | ".join(fmt(key, r.summary) for r in results) + " |")
    outcomes = sorted({k for r in results for k in r.summary["outcomes"] if k != "ok"})
    for o in outcomes:
        lines.append(f"| not served: {o} | " + " | ".join(str(r.summary["outcomes"].get(o, 0)) for r in results) + " |")
    return "\n".join(lines)


def engine_table(results: Sequence[PoolResult]) -> str:
    cols = [(r, i) for r in results for i in range(len(r.summary["engines"]))]
    lines = [
        "| per engine | " + " | ".join(f"{r.arm} e{i}" for r, i in cols) + " |",
        "| --- |" + " --- |" * len(cols),
    ]
    for label, key in ENGINE_ROWS:
        lines.append(f"| {label} | " + " | ".join(fmt(key, r.summary["engines"][i]) for r, i in cols) + " |")
    return "\n".join(lines)


# --- the reference: one engine's best stable throughput -------------------------------------------------


def single_engine_reference(sc: Scenario, spec: PoolSpec, results_dir: Path) -> dict[str, Any] | None:
    """One engine's best stable throughput for the scenario's request shape: the higher of the HTTP and the
    in-process sweeps saved by ``spec.single_engine_sweep`` (when its shape is this scenario's), else the
    in-process sweep (``bound.closed_loop_capacity``) of engine 0 over the scenario's sweep levels."""
    cls = max(sc.classes, key=lambda c: c.prompt_tokens.max)
    shape = {
        "prompt_tokens": [cls.prompt_tokens.min, cls.prompt_tokens.max],
        "max_tokens": None if cls.max_tokens is None else [cls.max_tokens.min, cls.max_tokens.max],
    }
    saved = results_dir / spec.single_engine_sweep / "sweep.json" if spec.single_engine_sweep else None
    if saved is not None and saved.exists():
        sw = json.loads(saved.read_text())
        if {k: sw["shape"][k] for k in shape} == shape:
            cands = []
            if sw.get("best_stable"):
                cands.append({**sw["best_stable"], "source": f"HTTP sweep of {spec.single_engine_sweep}"})
            if sw.get("best_stable_in_process"):
                cands.append(
                    {**sw["best_stable_in_process"], "source": f"in-process sweep of {spec.single_engine_sweep}"}
                )
            in_band = [
                {
                    "concurrency": r["concurrency"],
                    "output_tok_per_s": max(r["output_tok_per_s"], r["in_process"]["output_tok_per_s"]),
                    "http": r["output_tok_per_s"],
                    "in_process": r["in_process"]["output_tok_per_s"],
                }
                for r in sw["rows"]
                if r["stable"] and r["peak_kv_usage"] <= BAND and r["in_process"]["stable"]
            ]
            best = max(cands, key=lambda r: r["output_tok_per_s"]) if cands else None
            if best is not None:
                best["in_band"] = max(in_band, key=lambda r: r["output_tok_per_s"], default=None)
            return best
    levels = sc.sweep_concurrency or (64, 96, 128, 144, 152)
    single = _single(sc, spec)
    cfg = sc.sweep
    rows = [
        closed_loop_capacity(single, c, cfg.duration_s, cfg.warmup_s, stagger_s=cfg.stagger_s, largest_class=True)
        for c in levels
    ]
    stable = [r for r in rows if r["stable"]]
    best_ip = max(stable, key=lambda r: r["output_tok_per_s"], default=None)
    return None if best_ip is None else {**best_ip, "source": "in-process sweep of one engine", "in_band": None}


def _single(sc: Scenario, spec: PoolSpec) -> Scenario:
    return dataclasses.replace(sc, sim_args=(*sc.sim_args, *spec.engine_args_of(0)))


def _engine_configs(sc: Scenario, spec: PoolSpec) -> list[SimConfig]:
    """Each engine of the pool as the scenario starts it, for the in-process runs."""
    return pool_bound.engine_configs([[*sc.sim_args, *spec.engine_args_of(i)] for i in range(spec.engines)])


def bound(sc: Scenario, spec: PoolSpec) -> dict[str, Any]:
    """The plan through the pool in-process (``pool_bound``), shared queue and round robin, at the gateway's
    queue wait limit."""
    configs, arrivals = _engine_configs(sc, spec), sc.arrivals()
    wait = float(sc.gateway.get("admission", {}).get("queue_max_wait_s", math.inf))
    return {p: pool_bound.pool_run(arrivals, configs, p, BAND, wait) for p in pool_bound.POLICIES}


CEILING_BANDS = (0.90, 1.0, 100.0)  # 100 x the pool: no limit (an infinite band would make every engine tie)


def ceiling(sc: Scenario, spec: PoolSpec) -> dict[str, float]:
    """Whole-run output throughput of the plan through the pool in-process, one shared FIFO queue placing by
    exact worst-case reservations (the plan's outputs are its ``max_tokens``) up to 0.90 of every engine, up to
    all of it, and without any limit (an OOM step counted, not enacted): what the engine model itself makes of
    this plan whatever the admission. A one-shot burst starts with every engine prefilling and ends draining
    its last requests, so this sits below N x a steady closed loop's best."""
    configs, arrivals = _engine_configs(sc, spec), sc.arrivals()
    top: dict[str, float] = {}
    for band in CEILING_BANDS:
        label = "no limit" if band > 1 else f"{band:.2f} of every engine's KV"
        top[label] = pool_bound.pool_run(arrivals, configs, "shared", band)["output_tok_per_s"]
    return top


def bound_line(b: dict[str, Any]) -> str:
    parts = []
    for policy, r in b.items():
        parts.append(
            f"{policy}: served {r['served']} / {r['requests']}, refused {r['refused']}, {r['output_tok_per_s']:,.0f} "
            f"tok/s whole run, TTFT p99 {r['ttft_p99_s']:.1f} s, peak KV "
            + "/".join(f"{e['peak_kv_usage']:.2f}" for e in r["engines"])
        )
    return (
        "- for reference (not a check): the same plan through the engine model in-process (`loadtests/pool_bound.py`: "
        "no HTTP, FIFO admission by worst-case reservations within 0.90 of each engine, queue wait limit as the "
        "gateway's) — " + "; ".join(parts) + "."
    )


# --- checks -----------------------------------------------------------------------------------------------


def _by(results: Sequence[PoolResult]) -> dict[str, PoolResult]:
    return {r.arm: r for r in results}


def safety_checks(r: PoolResult, engines: Sequence[int] | None = None, what: str = "pool-kvgate") -> list[str]:
    idx = list(engines) if engines is not None else list(range(len(r.summary["engines"])))
    per = [r.summary["engines"][i] for i in idx]
    names = ", ".join(f"e{i}" for i in idx)
    return [
        _check(
            all(e["oom_crashes"] == 0 for e in per),
            f"{what}: OOM crashes per engine ({names}): " + " / ".join(str(e["oom_crashes"]) for e in per),
        ),
        _check(
            all(e["preemptions"] == 0 for e in per),
            f"{what}: preemptions per engine ({names}): " + " / ".join(f"{e['preemptions']:.0f}" for e in per),
        ),
        _check(
            all(e["peak_kv_usage"] <= BAND for e in per),
            f"{what}: peak sampled KV usage <= {BAND:.2f} on every engine ({names}): "
            + " / ".join(_f(e["peak_kv_usage"]) for e in per),
        ),
    ]


def throughput_check(
    r: PoolResult, ref: dict[str, Any] | None, n: int, saturated: bool, top: dict[str, float] | None = None
) -> list[str]:
    g = r.summary
    if ref is None:
        return [_check(False, "no stable single-engine sweep level to judge the pool's throughput against")]
    target = n * ref["output_tok_per_s"]
    key, what = ("saturated_tok_per_s", "while demand queued") if saturated else ("output_tok_per_s", "whole run")
    ratio = g[key] / target
    line = _check(
        ratio >= THROUGHPUT_FRAC,
        f"pool-kvgate: output throughput ({what}) {g[key]:,.0f} tok/s = {ratio:.0%} of {n} x the single engine's best "
        f"stable throughput ({n} x {ref['output_tok_per_s']:,.0f} = {target:,.0f} tok/s; {ref['source']}, concurrency "
        f"{ref['concurrency']}); at least {THROUGHPUT_FRAC:.0%}",
    )
    lines = [line]
    if saturated:
        alt, span = pool_saturated_throughput(r.engines, r.gateways, engine_waiting=True)
        whole = g["output_tok_per_s"]
        lines.append(
            "- the window is the first to the last moment kvgate's queue held a request "
            f"({g['saturated_window_s']:.1f} s). Counting the engines' own waiting queues too, as the "
            "single-engine sections do, the window starts at the first arrivals, while the engines are still "
            f"filling ({span:.1f} s): {alt:,.0f} tok/s = {alt / target:.0%}. Whole run (first send to last "
            f"response): {whole:,.0f} tok/s = {whole / target:.0%}. Requests admitted together finish together, "
            "so the pool's output swings with a period of about one request's life, and the figure moves by "
            "several percent with the window's edges."
        )
    if top is not None and not saturated:
        best = max(top.values())
        lines.append(
            "- the plan's own ceiling (in-process, one FIFO queue, exact reservations; whole-run tok/s with admission "
            "limited to "
            + "; ".join(f"{k}: {v:,.0f}" for k, v in top.items())
            + f"): at most {best / target:.0%} of the target, whatever the admission: a one-shot burst starts with "
            "every engine prefilling and ends draining its last requests, which a steady closed loop never does. "
            f"pool-kvgate = {g[key] / best:.0%} of the highest."
        )
    band = ref.get("in_band")
    if band:
        lines.append(
            f"- for reference: the best sweep level that stayed inside the band (peak sampled KV <= {BAND} in the HTTP "
            f"sweep) is concurrency {band['concurrency']}: {band['http']:,.0f} tok/s per engine over HTTP, "
            f"{band['in_process']:,.0f} in-process; pool-kvgate = {g[key] / (n * band['output_tok_per_s']):.0%} of "
            f"{n} x the higher."
        )
    return lines


def pool_checks(
    results: Sequence[PoolResult],
    ref: dict[str, Any] | None,
    b: dict[str, Any] | None,
    saturated: bool,
    top: dict[str, float] | None = None,
) -> list[str]:
    """The pool's claims: safe on every engine, near N x one engine's throughput, better tail than sidecars."""
    by = _by(results)
    g = by["pool-kvgate"]
    n = len(g.summary["engines"])
    lines = safety_checks(g)
    lines += throughput_check(g, ref, n, saturated, top)
    if "sidecar" in by:
        s = by["sidecar"].summary
        lines.append(
            _check(
                g.summary["ttft_p99_s"] < s["ttft_p99_s"],
                f"pool-kvgate: TTFT p99 {g.summary['ttft_p99_s']:.2f} s, strictly better than the sidecar layout's "
                f"{s['ttft_p99_s']:.2f} s (p50 {g.summary['ttft_p50_s']:.2f} vs {s['ttft_p50_s']:.2f} s; served "
                f"{g.summary['served']} vs {s['served']} of {g.summary['requests']})",
            )
        )
    ok = all(r.ok or (r.status in (429, 503) and r.retry_after is not None) for r in g.records)
    lines.append(_check(ok, "pool-kvgate: every request served, or refused with 429/503 + Retry-After"))
    return lines + reference_lines(results, b)


def reference_lines(results: Sequence[PoolResult], b: dict[str, Any] | None) -> list[str]:
    """Under the checks: the in-process model's figures, and who refused how many against it."""
    lines = [] if b is None else [bound_line(b)]
    refused = [r for r in results if r.summary["refusals"]]
    if refused:
        lines.append(refusal_line(refused, b))
    return lines


def refusal_line(results: Sequence[PoolResult], b: dict[str, Any] | None) -> str:
    """How many each gateway arm refused, against the in-process model at the same queue wait limit, and how
    long the requests it served had waited at most."""
    parts = []
    for r in results:
        codes: dict[str, int] = {}
        for x in r.records:
            if x.status in (429, 503):
                codes[x.error_code or "?"] = codes.get(x.error_code or "?", 0) + 1
        ttft = [x.ttft for x in r.records if x.ok and x.ttft is not None]
        parts.append(
            f"{r.arm} refused {r.summary['refusals']} ("
            + ", ".join(f"{k} {v}" for k, v in sorted(codes.items()))
            + f"), longest TTFT of a served request {max(ttft, default=math.nan):.1f} s"
        )
    model = ""
    if b is not None:
        model = "; the in-process model refuses " + " / ".join(f"{v['refused']} ({k})" for k, v in b.items())
    return "- refusals (not a check): " + "; ".join(parts) + model + "."


def not_served(s: dict[str, Any]) -> int:
    return int(s["requests"] - s["served"])


def hetero_checks(results: Sequence[PoolResult], b: dict[str, Any] | None) -> list[str]:
    by = _by(results)
    g = by["pool-kvgate"].summary
    lines = safety_checks(by["pool-kvgate"])
    for arm in ("direct-rr", "sidecar"):
        if arm not in by:
            continue
        o = by[arm].summary
        lines.append(
            _check(
                g["output_tok_per_s"] > o["output_tok_per_s"],
                f"pool-kvgate beats {arm} on throughput (whole run): {g['output_tok_per_s']:,.0f} vs "
                f"{o['output_tok_per_s']:,.0f} tok/s ({g['output_tok_per_s'] / o['output_tok_per_s'] - 1:+.1%}; while "
                f"demand queued {g['saturated_tok_per_s']:,.0f} vs {o['saturated_tok_per_s']:,.0f})",
            )
        )
        lines.append(
            _check(
                not_served(g) < not_served(o),
                f"pool-kvgate beats {arm} on refusals: {not_served(g)} vs {not_served(o)} requests not served "
                f"(refused 429/503: {g['refusals']} vs {o['refusals']}; failed: {g['failed']} vs {o['failed']})",
            )
        )
    return lines + reference_lines(results, b)


def fault_stats(r: PoolResult, engine: int) -> dict[str, Any]:
    ev = r.events
    ejected = r.gateway_series(engine, "ejected")
    reserved = r.gateway_series(engine, "reserved")
    placements = r.gateway_series(engine, "placements")
    kill, ready = ev.kill_at, ev.ready_at
    assert kill is not None and ready is not None
    after = [(t, v) for t, v in ejected if t >= kill]
    ejected_at = next((t for t, v in after if v >= 1), None)
    back_at = next((t for t, v in after if ejected_at is not None and t > ejected_at and v == 0), None)
    zero_at = next((t for t, v in reserved if t >= kill and v == 0), None)
    dead = [v for t, v in reserved if kill + DEAD_GRACE_S <= t <= ready]
    # the last reading while it was out (the first one after it rejoined may already count new placements)
    before_back = max((v for t, v in placements if back_at is None or t < back_at), default=math.nan)
    final = max((v for _, v in placements), default=math.nan)
    at_kill = max((v for t, v in placements if t < kill), default=0.0)
    at_eject = max((v for t, v in placements if ejected_at is not None and t <= ejected_at), default=at_kill)
    return {
        "first_send": min((rec.sent for rec in r.records), default=math.nan),
        "kill_at": kill,
        "ready_at": ready,
        "ejected_at": ejected_at,
        "back_at": back_at,
        "reserved_zero_at": zero_at,
        "reserved_max_while_dead": max(dead, default=math.nan),
        "reserved_samples_while_dead": len(dead),
        "placements_before_rejoin": before_back,
        "placements_after_rejoin": final - before_back,
        "placements_kill_to_eject": at_eject - at_kill,
        "ejections": max((v for _, v in r.gateway_series(engine, "ejections")), default=math.nan),
        "restarts_seen": max((v for _, v in r.gateway_series(engine, "restarts")), default=math.nan),
    }


def fault_checks(results: Sequence[PoolResult], engine: int) -> list[str]:
    r = _by(results)["pool-kvgate"]
    s = r.summary
    st = fault_stats(r, engine)
    others = [i for i in range(len(s["engines"])) if i != engine]
    lines = [
        f"- the harness killed engine e{engine} (SIGKILL) at {st['kill_at']:.1f} s "
        f"({st['kill_at'] - st['first_send']:.1f} s after the first request was sent), started it again at "
        f"{r.events.restart_at:.1f} s, answering /health at {st['ready_at']:.1f} s; kvgate counted "
        f"{st['ejections']:.0f} ejection(s) and {st['restarts_seen']:.0f} restart(s) of it "
        "(kvgate_engine_ejections_total, kvgate_engine_restarts_total).",
        *safety_checks(r, others, "pool-kvgate, the engines not killed"),
        _check(
            s["hung"] == 0 and s["unfinished"] == 0,
            f"no request hangs: {s['hung']} requests still open at the deadline, {s['unfinished']} without an end; "
            f"{s['served']} served, {s['refusals']} refused, {s['failed']} failed of {s['requests']} "
            f"({', '.join(f'{k} {v}' for k, v in sorted(s['outcomes'].items()))})",
        ),
        _check(
            st["ejected_at"] is not None and st["back_at"] is not None,
            f"kvgate_engine_ejected of e{engine} went to 1 at "
            f"{_f(st['ejected_at'], 2)} s ({_f((st['ejected_at'] or math.nan) - st['kill_at'], 2)} s after the kill) "
            f"and back to 0 at {_f(st['back_at'], 2)} s ({_f((st['back_at'] or math.nan) - st['ready_at'], 2)} s "
            "after it answered /health)",
        ),
        _check(
            st["reserved_samples_while_dead"] > 0 and st["reserved_max_while_dead"] == 0,
            f"the ledger of e{engine} was dropped: kvgate_engine_reserved_blocks read 0 from "
            f"{_f(st['reserved_zero_at'], 2)} s ({_f((st['reserved_zero_at'] or math.nan) - st['kill_at'], 2)} s after "
            f"the kill); highest reading from {DEAD_GRACE_S:g} s after the kill until it answered /health: "
            f"{_f(st['reserved_max_while_dead'], 0)} blocks over {st['reserved_samples_while_dead']} samples",
        ),
        f"- between the kill and the ejection kvgate_engine_placements_total of e{engine} rose by "
        f"{st['placements_kill_to_eject']:.0f} (requests placed on the dead engine, refused the connection, placed "
        f"again); of the {s['failed']} failed requests, "
        f"{sum(1 for x in r.records if x.status == 200 and x.error_code == 'ClientPayloadError')} got 200 and a "
        "stream cut without an SSE error event (the client's `ClientPayloadError`), "
        f"{sum(1 for x in r.records if x.status == 502)} a 502 before any byte.",
        _check(
            st["placements_after_rejoin"] > 0,
            f"e{engine} took placements again after rejoining: {st['placements_after_rejoin']:.0f} "
            f"(kvgate_engine_placements_total {st['placements_before_rejoin']:.0f} when it rejoined)",
        ),
    ]
    return lines


# --- plots ------------------------------------------------------------------------------------------------


def _marks(ax: Any, r: PoolResult) -> None:
    for t, label, color in ((r.events.kill_at, "kill", "r"), (r.events.ready_at, "back", "g")):
        if t is not None:
            ax.axvline(t, color=color, ls="-.", lw=0.8, label=label)


def plots(results: Sequence[PoolResult], out_dir: Path, title: str) -> list[Path]:
    paths = []
    n = len(results)

    def grid(name: str, ylabel: str, draw: Any, kv: bool = False) -> None:
        fig, axes = plt.subplots(1, n, figsize=(5 * n, 3.2), sharey=True, squeeze=False)
        for ax, r in zip(axes[0], results, strict=True):
            draw(ax, r)
            if kv:
                ax.axhline(BAND, color="r", ls="--", lw=0.8)
                ax.axhline(0.8, color="g", ls=":", lw=0.8)
                ax.set_ylim(0, 1.05)
            _marks(ax, r)
            ax.set_title(r.arm, fontsize=9)
            ax.set_xlabel("simulated s")
            ax.legend(fontsize=6)
        axes[0][0].set_ylabel(ylabel)
        fig.suptitle(f"{title}: {ylabel}", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)

    def kv(ax: Any, r: PoolResult) -> None:
        for i, e in enumerate(r.engines):  # NaN while down: the line breaks instead of bridging the gap
            ax.plot([s.t for s in e], [s.kv if s.up else math.nan for s in e], lw=0.9, label=f"e{i}")
            down = [s.t for s in e if not s.up]
            if down:
                ax.plot(down, [0.0] * len(down), "x", ms=3, color=f"C{i}")

    def placements(ax: Any, r: PoolResult) -> None:
        for i in range(len(r.engines)):
            if r.arm == "direct-rr":
                ts = sorted(rec.sent for rec, route in zip(r.records, r.routes, strict=True) if route == i)
                ax.step(ts, range(1, len(ts) + 1), where="post", lw=0.9, label=f"e{i} (sent)")
            else:
                pts = r.gateway_series(i, "placements")
                ax.plot([t for t, _ in pts], [v for _, v in pts], lw=0.9, label=f"e{i}")

    def throughput(ax: Any, r: PoolResult) -> None:
        for i, e in enumerate(r.engines):
            pts = throughput_series(e, 1.0)
            ax.plot([t for t, _ in pts], [v for _, v in pts], lw=0.8, label=f"e{i}")

    def queues(ax: Any, r: PoolResult) -> None:
        for i, e in enumerate(r.engines):
            ax.plot([s.t for s in e], [s.waiting for s in e], lw=0.8, label=f"e{i} waiting")
        for j, g in enumerate(r.gateways):
            label = "kvgate queue" if len(r.gateways) == 1 else f"kvgate e{j} queue"
            ax.plot([s.t for s in g], [s.get("queue") for s in g], lw=0.8, ls="--", label=label)

    grid("kv_usage_per_engine", "KV cache usage per engine", kv, kv=True)
    grid("placements", "requests placed per engine (cumulative)", placements)
    grid("throughput_per_engine", "generation tok/s per engine (1 s window)", throughput)
    grid("queue_depth", "queued requests", queues)
    faulted = [r for r in results if r.events.kill_at is not None]
    if faulted:
        paths.append(fault_plot(faulted[0], out_dir, title))
    return paths


def fault_plot(r: PoolResult, out_dir: Path, title: str) -> Path:
    keys = (
        ("ejected", "kvgate_engine_ejected"),
        ("reserved", "kvgate_engine_reserved_blocks"),
        ("placements", "kvgate_engine_placements_total"),
        ("kv", "kvgate_engine_kv_usage_observed"),
    )
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.2 * len(keys)), sharex=True)
    for ax, (key, name) in zip(axes, keys, strict=True):
        for i in range(len(r.engines)):
            pts = r.gateway_series(i, key)
            ax.plot([t for t, _ in pts], [v for _, v in pts], lw=0.9, label=f"e{i}")
        _marks(ax, r)
        ax.set_ylabel(name.removeprefix("kvgate_engine_"), fontsize=8)
        ax.legend(fontsize=6, ncol=3)
    axes[-1].set_xlabel("simulated s")
    fig.suptitle(f"{title}: kvgate's books per engine around the kill", fontsize=10)
    fig.tight_layout()
    path = out_dir / "fault.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# --- the report's section ---------------------------------------------------------------------------------


def section(
    name: str, scenario_path: Path, results_dir: Path, reuse: bool = False, arms: Sequence[str] | None = None
) -> str:
    """Run (or, ``reuse``, read back) every arm of a pool scenario; its REPORT.md section, also saved as
    ``<results>/<name>/section.md``."""
    sc, spec = load_pool(scenario_path)
    dest = results_dir / name
    dest.mkdir(parents=True, exist_ok=True)
    res = compare_pool(sc, spec, dest, arms=arms, reuse=reuse)
    plots(res, dest, name)
    saved_bound = dest / "bound.json"
    b: dict[str, Any] | None = None
    if spec.checks != "fault":
        if reuse and saved_bound.exists():
            b = json.loads(saved_bound.read_text())
        else:
            b = bound(sc, spec)
            saved_bound.write_text(json.dumps(b, indent=2) + "\n")
    if "pool-kvgate" not in {r.arm for r in res}:
        checks = []
    elif spec.checks in ("burst", "overload"):
        ref = single_engine_reference(sc, spec, results_dir)
        saturated = spec.checks == "overload"
        checks = pool_checks(res, ref, b, saturated, None if saturated else ceiling(sc, spec))
    elif spec.checks == "hetero":
        checks = hetero_checks(res, b)
    elif spec.checks == "fault":
        assert spec.fault is not None
        checks = fault_checks(res, spec.fault.engine)
    else:
        checks = []
    lags = ", ".join(f"{r.arm} " + "/".join(_f(v, 1) for v in r.summary["sim_lag_real_s_per_engine"]) for r in res)
    body = [
        f"## {name}",
        "",
        sc.description.strip(),
        "",
        f"{spec.engines} engines ({_engine_list(sc, spec)}), time scale {sc.time_scale:g} (real seconds per "
        f"simulated second); arms: {', '.join(r.arm for r in res)}. Simulator lag per engine (real s): {lags}. "
        "Run: "
        + "; ".join(f"{r.arm} {r.summary.get('started', '?')} on {r.summary.get('revision', '?')}" for r in res)
        + ".",
        "",
        table(res),
        "",
        engine_table(res),
        "",
    ]
    if checks:
        body += ["Checks:", "", *checks, ""]
    for png, alt in (
        ("kv_usage_per_engine", "KV usage per engine"),
        ("placements", "placements per engine"),
        ("queue_depth", "queue depth"),
        ("throughput_per_engine", "throughput per engine"),
        ("fault", "kvgate's books around the kill"),
    ):
        if (dest / f"{png}.png").exists() and (png != "fault" or spec.fault is not None):
            body += [f"![{alt}]({name}/{png}.png)", ""]
    text = "\n".join(body)
    (dest / "section.md").write_text(text)
    return text


def _engine_list(sc: Scenario, spec: PoolSpec) -> str:
    parts = []
    for i in range(spec.engines):
        extra = " ".join(spec.engine_args_of(i))
        parts.append(f"e{i}: `{' '.join(sc.sim_args)}{' ' + extra if extra else ''}`")
    return (
        "; ".join(parts)
        if any(spec.engine_args_of(i) for i in range(spec.engines))
        else f"each `{' '.join(sc.sim_args)}`"
    )
