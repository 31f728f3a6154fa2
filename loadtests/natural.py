"""Report pieces for traffic whose outputs stop on their own (issue 11): the throughput reference for that
traffic, the kvgate arm's checks, the output estimator's error over time, and the deadline scenario's checks.

All pure over saved results except :func:`reference`, which runs the scenario's plan (and a closed loop of
its mix) in-process through the simulator's engine (deterministic, no HTTP).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtests.bound import burst_bound, closed_loop_capacity
from loadtests.compare import ArmResult
from loadtests.scenario import Scenario
from loadtests.stats import RETRYABLE, RequestRecord, percentile

PREEMPTION_FRAC = 0.005
PEAK_KV = 0.92
THROUGHPUT_FRAC = 0.95
REFUSAL_WAIT_SLACK_S = 1.0
RETRY_ADMITTED_FRAC = 0.80


def _check(ok: bool, text: str) -> str:
    return f"- **{'PASS' if ok else 'FAIL'}**: {text}"


def reference(sc: Scenario, caps: Sequence[int], levels: Sequence[int]) -> dict[str, Any]:
    """The engine's best stable throughput for this traffic, in-process:

    * ``plan``: the scenario's own request plan (same arrivals, prompts and natural lengths) under a FIFO cap
      of ``c`` requests in the engine, best stable whole-run output tok/s over ``caps`` (the offered work as
      it arrives, start and drain included: what an ideal admission policy can get out of the engine);
    * ``closed_loop``: clients drawing from the scenario's mix back to back, best stable steady-state output
      tok/s over ``levels`` (the engine's capacity for this mix; above the plan's when the plan offers less).
    """
    plan = burst_bound(sc, tuple(caps))
    rows = [closed_loop_capacity(sc, c, 120.0, 30.0, stagger_s=10.0, mixed=True) for c in levels]
    stable = [r for r in rows if r["stable"]]
    return {
        "plan": plan,
        "closed_loop": {"rows": rows, "best_stable": max(stable, key=lambda r: r["output_tok_per_s"], default=None)},
    }


def arm_reference(res: Sequence[ArmResult]) -> dict[str, Any] | None:
    """The fallback reference: the best whole-run throughput of the direct / vllm-queue arms that did not crash."""
    ok = [r for r in res if r.arm in ("direct", "vllm-queue") and r.summary["oom_crashes"] == 0]
    best = max(ok, key=lambda r: r.summary["output_tok_per_s"], default=None)
    return None if best is None else {"arm": best.arm, "output_tok_per_s": best.summary["output_tok_per_s"]}


def reference_table(ref: dict[str, Any]) -> str:
    lines = [
        "Reference, in-process through the simulator's engine (no HTTP, no gateway; `loadtests/natural.py`): "
        "this scenario's plan under a FIFO cap of c requests in the engine (whole run = output tokens / makespan), "
        "and a closed loop of c clients drawing from the mix (steady state, 30-120 s):",
        "",
        "| c | plan: output tok/s (whole run) | plan: peak KV | plan: preemptions | plan: OOM steps | plan: stable |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in ref["plan"]["rows"]:
        cap = "none" if r["cap"] >= 100_000 else str(r["cap"])
        lines.append(
            f"| {cap} | {r['output_tok_per_s']:,.0f} | {r['peak_kv_usage']:.3f} | {r['preemptions']} | "
            f"{r['oom_steps']} | {'yes' if r['stable'] else 'no'} |"
        )
    lines += ["", "| c | closed loop: output tok/s | req/s | mean KV | preemptions | OOM steps | stable |"]
    lines += ["| --- | --- | --- | --- | --- | --- | --- |"]
    for r in ref["closed_loop"]["rows"]:
        lines.append(
            f"| {r['concurrency']} | {r['output_tok_per_s']:,.0f} | {r['req_per_s']:.1f} | {r['mean_kv_usage']:.3f} "
            f"| {r['preemptions']} | {r['oom_steps']} | {'yes' if r['stable'] else 'no'} |"
        )
    return "\n".join([*lines, ""])


def natural_checks(res: Sequence[ArmResult], ref: dict[str, Any]) -> list[str]:
    by = {r.arm: r for r in res}
    g = by["kvgate"].summary
    sent = sum(1 for r in by["kvgate"].records if r.attempt == 0)
    lines = [
        _check(g["oom_crashes"] == 0, f"through kvgate: {g['oom_crashes']} OOM crashes"),
        _check(
            g["preemptions"] <= PREEMPTION_FRAC * sent,
            f"through kvgate: {g['preemptions']:.0f} preemptions for {sent} requests "
            f"({g['preemptions'] / sent:.2%}; at most {PREEMPTION_FRAC:.1%})",
        ),
        _check(
            g["peak_kv_usage"] <= PEAK_KV,
            f"through kvgate: peak sampled KV usage {g['peak_kv_usage']:.3f} <= {PEAK_KV}",
        ),
    ]
    best = ref["plan"]["best_stable"]
    if best is None:
        lines.append(_check(False, "no stable in-process run of the plan to judge the throughput against"))
    else:
        ratio = g["output_tok_per_s"] / best["output_tok_per_s"]
        cap = "no cap" if best["cap"] >= 100_000 else f"FIFO cap {best['cap']}"
        lines.append(
            _check(
                ratio >= THROUGHPUT_FRAC,
                f"through kvgate: output throughput (whole run) {g['output_tok_per_s']:,.0f} tok/s = {ratio:.1%} of "
                f"the engine's best stable throughput for this traffic, {best['output_tok_per_s']:,.0f} tok/s (the "
                f"same plan in-process, {cap}; at least {THROUGHPUT_FRAC:.0%})",
            )
        )
    arm_ref = arm_reference(res)
    cl = ref["closed_loop"]["best_stable"]
    extra = []
    if arm_ref is not None:
        extra.append(
            f"the best arm without a crash ({arm_ref['arm']}) {arm_ref['output_tok_per_s']:,.0f} tok/s, kvgate "
            f"{g['output_tok_per_s'] / arm_ref['output_tok_per_s']:.0%} of it"
        )
    if cl is not None:
        extra.append(
            f"the engine's closed-loop capacity for this mix {cl['output_tok_per_s']:,.0f} tok/s at "
            f"{cl['concurrency']} in flight (steady state, an upper bound the plan's offered work need not reach)"
        )
    if "kvgate-worst" in by:
        w = by["kvgate-worst"].summary
        extra.append(
            f"kvgate-worst (worst-case reservations) {w['output_tok_per_s']:,.0f} tok/s, served {w['served']} / "
            f"{w['requests']}, TTFT p50 {w['ttft_p50_s']:.2f} s"
        )
    if extra:
        lines.append("- for reference (not checks): " + "; ".join(extra) + ".")
    return lines


# --- the estimator's error ------------------------------------------------------------------------------


def estimator_points(records: Sequence[RequestRecord]) -> list[tuple[float, int, int]]:
    """(first-token time, reserved output, actual completion tokens) of every served request that said what it
    was reserved for (the ``x-kvgate-expected-output-tokens`` response header). The first token comes right
    after admission, when the estimate was made (by finish time, long requests would all sit at the end)."""
    return sorted(
        (r.sent + (r.ttft or 0.0), r.expected_output, r.completion_tokens)
        for r in records
        if r.ok and r.expected_output is not None and r.completion_tokens > 0
    )


def estimator_stats(records: Sequence[RequestRecord]) -> dict[str, Any]:
    pts = estimator_points(records)
    if not pts:
        return {"n": 0}
    ratios = [e / a for _, e, a in pts]
    return {
        "n": len(pts),
        "ratio_p10": percentile(ratios, 0.1),
        "ratio_p50": percentile(ratios, 0.5),
        "ratio_p90": percentile(ratios, 0.9),
        "outran_frac": sum(1 for _, e, a in pts if a > e) / len(pts),
        "reserved_over_actual": sum(e for _, e, _ in pts) / sum(a for _, _, a in pts),
        "actual_p70": percentile([a for _, _, a in pts], 0.7),
        "learned_reserved_p50": percentile([e for _, e, _ in pts if e < 1000], 0.5),  # not the budget
    }


def estimator_lines(res: Sequence[ArmResult]) -> list[str]:
    lines = []
    for r in res:
        if r.arm not in ("kvgate", "kvgate-worst"):
            continue
        st = estimator_stats(r.records)
        if not st["n"]:
            lines.append(f"- {r.arm}: no request reported its reservation")
            continue
        outran = max((s.outran for s in r.samples if not math.isnan(s.outran)), default=math.nan)
        lines.append(
            f"- {r.arm}: reserved output / actual completion tokens over {st['n']} served requests: p10 "
            f"{st['ratio_p10']:.2f}, median {st['ratio_p50']:.2f}, p90 {st['ratio_p90']:.2f}; "
            f"{st['outran_frac']:.0%} produced more than they were admitted for (the gateway's "
            f"kvgate_requests_outran_estimate_total ended at {outran:.0f}); reserved output summed over the run = "
            f"{st['reserved_over_actual']:.2f}x the output produced. The 0.7 quantile of what was produced: "
            f"{st['actual_p70']:.0f} tokens"
            + (
                f"; median reserved while learned (reservations under 1,000 tokens): {st['learned_reserved_p50']:.0f}"
                if not math.isnan(st["learned_reserved_p50"])
                else ""
            )
        )
    return lines


def estimator_plot(res: Sequence[ArmResult], out_dir: Path, title: str) -> Path | None:
    arms = [r for r in res if r.arm in ("kvgate", "kvgate-worst") and estimator_points(r.records)]
    if not arms:
        return None
    fig, axes = plt.subplots(2, len(arms), figsize=(6 * len(arms), 5.5), squeeze=False, sharex=True)
    for col, r in enumerate(arms):
        pts = estimator_points(r.records)
        t = [p[0] for p in pts]
        ratio = [p[1] / p[2] for p in pts]
        ax = axes[0][col]
        ax.scatter(t, ratio, s=3, alpha=0.35, lw=0)
        w = 50  # rolling median over 50 finished requests
        med = [statistics.median(ratio[max(0, i - w + 1) : i + 1]) for i in range(len(ratio))]
        ax.plot(t, med, color="k", lw=1, label="rolling median (50 requests)")
        ax.axhline(1.0, color="r", ls="--", lw=0.8, label="reserved = actual")
        ax.set_yscale("log")
        ax.set_title(f"{r.arm}: reserved output / actual completion tokens", fontsize=9)
        ax.legend(fontsize=7)
        ax2 = axes[1][col]
        ax2.plot(t, [p[1] for p in pts], ".", ms=2, alpha=0.4, label="reserved output (per request)")
        ax2.plot(t, [p[2] for p in pts], ".", ms=2, alpha=0.4, label="actual completion tokens")
        ax2.set_yscale("log")
        ax2.set_xlabel("first token, ~admission (simulated s)")
        q = [(s.t, s.estimate_quantile) for s in r.samples if not math.isnan(s.estimate_quantile)]
        if q:
            ax3 = ax2.twinx()
            ax3.plot([x for x, _ in q], [y for _, y in q], color="g", lw=1, label="reserved quantile (gauge)")
            ax3.set_ylim(0, 1.05)
            ax3.legend(fontsize=7, loc="lower right")
        ax2.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("ratio (log)")
    axes[1][0].set_ylabel("tokens (log)")
    fig.suptitle(f"{title}: output reserved at admission vs produced", fontsize=10)
    fig.tight_layout()
    path = out_dir / "estimator_error.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# --- deadlines ------------------------------------------------------------------------------------------


def refusal_wait(r: RequestRecord) -> float:
    """How long a refused request waited before the refusal: the body's ``waited_s`` when it says (refused
    from the queue), else the client's round trip (refused on arrival)."""
    return r.waited_s if r.waited_s is not None else (r.latency or 0.0)


def told_to_expect(r: RequestRecord) -> float:
    """The wait a refused request had been told to expect: 0 when refused on arrival, else the estimate it was
    queued with (the refusal body's ``estimated_wait_s``), or its whole budget when there was none."""
    if r.waited_s is None:
        return 0.0
    if r.estimated_wait_s is not None:
        return r.estimated_wait_s
    return r.max_wait_s if r.max_wait_s is not None else 0.0


def deadline_stats(records: Sequence[RequestRecord]) -> dict[str, Any]:
    first = [r for r in records if r.attempt == 0]
    retries = [r for r in records if r.attempt == 1]
    refused = [r for r in records if r.status in RETRYABLE]
    waits = [refusal_wait(r) for r in refused]
    late = [r for r in refused if refusal_wait(r) > told_to_expect(r) + REFUSAL_WAIT_SLACK_S]
    over_budget = [r for r in refused if r.max_wait_s is not None and refusal_wait(r) > r.max_wait_s + 1.0]
    codes: dict[str, int] = {}
    for r in refused:
        codes[r.error_code or "?"] = codes.get(r.error_code or "?", 0) + 1
    served_first = [r for r in first if r.ok]
    retried_ok = [r for r in retries if r.status == 200]
    admitted_ttft = [r.ttft for r in records if r.ok and r.ttft is not None]
    return {
        "requests": len(first),
        "served_first_try": len(served_first),
        "refused_first_try": sum(1 for r in first if r.status in RETRYABLE),
        "retries": len(retries),
        "retries_admitted": len(retried_ok),
        "retries_served": sum(1 for r in retries if r.ok),
        "served_total": sum(1 for r in records if r.ok),
        "refusals": len(refused),
        "refusal_codes": codes,
        "refusal_wait_p50_s": percentile(waits, 0.5),
        "refusal_wait_max_s": max(waits, default=math.nan),
        "refused_late": len(late),
        "refused_from_queue": sum(1 for r in refused if r.waited_s is not None),
        "refused_over_budget": len(over_budget),
        "refused_without_retry_after": sum(1 for r in refused if r.retry_after is None),
        "retry_after_p50_s": percentile([float(r.retry_after) for r in refused if r.retry_after], 0.5),
        "ttft_p50_s": percentile(admitted_ttft, 0.5),
        "ttft_p99_s": percentile(admitted_ttft, 0.99),
        "ttft_max_s": max(admitted_ttft, default=math.nan),
    }


def deadline_checks(res: Sequence[ArmResult]) -> list[str]:
    d = deadline_stats({r.arm: r for r in res}["kvgate"].records)
    frac = d["retries_admitted"] / d["retries"] if d["retries"] else math.nan
    codes = ", ".join(f"{k} {v}" for k, v in sorted(d["refusal_codes"].items())) or "none"
    return [
        f"- through kvgate: {d['requests']} requests; {d['served_first_try']} served on the first try, "
        f"{d['refused_first_try']} refused; {d['retries']} retried once after the Retry-After (median "
        f"{d['retry_after_p50_s']:.1f} s), {d['retries_admitted']} of them admitted and {d['retries_served']} "
        f"served; {d['served_total']} served in all. Refusals by code: {codes}. TTFT of served requests p50 "
        f"{d['ttft_p50_s']:.2f} s, p99 {d['ttft_p99_s']:.2f} s, max {d['ttft_max_s']:.2f} s (budget 10 s). "
        f"The table above counts attempts (requests + retries).",
        _check(
            d["refused_late"] == 0,
            f"through kvgate: no request is refused after waiting more than {REFUSAL_WAIT_SLACK_S:g} s beyond the "
            f"wait it was told to expect (0 for a refusal on arrival, else the estimate it was queued with): "
            f"{d['refused_late']} of {d['refusals']} refusals came later (refusal wait p50 "
            f"{d['refusal_wait_p50_s']:.2f} s, max {d['refusal_wait_max_s']:.2f} s: the 503 body's waited_s, or "
            f"the client's round trip when absent; {d['refused_from_queue']} refused after queueing); "
            f"{d['refused_over_budget']} after more than their budget + 1 s",
        ),
        _check(
            d["retries"] > 0 and frac >= RETRY_ADMITTED_FRAC,
            f"through kvgate: {d['retries_admitted']} of {d['retries']} retries that followed the Retry-After "
            f"were admitted on that first retry ({frac:.0%}; at least {RETRY_ADMITTED_FRAC:.0%})",
        ),
        _check(
            d["refused_without_retry_after"] == 0,
            f"through kvgate: every 429/503 carries Retry-After ({d['refused_without_retry_after']} without)",
        ),
    ]
