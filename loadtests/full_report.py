"""``python -m loadtests report``: the committed report, loadtests/results/REPORT.md, with its plots.

Runs the concurrency sweep for the burst's preset and shape, then ``compare`` on every scenario, and checks
the issue's claims against the numbers it just measured (each check prints PASS or FAIL with the values).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtests import compare, natural, pool_report, scenario
from loadtests.bound import burst_bound, closed_loop_capacity
from loadtests.report import plots, table
from loadtests.sweep import sweep

HERE = Path(__file__).resolve().parent
PLAN: list[tuple[str, tuple[str, ...]]] = [
    ("burst-8b-h100", ("direct", "kvgate", "vllm-queue")),
    ("burst-8b-h100-long", ("direct", "kvgate")),
    ("overload-2x", ("direct", "kvgate", "vllm-queue")),
    ("mixed-chat", ("direct", "kvgate")),
    ("multi-tenant", ("direct", "kvgate")),
    ("chat-natural-8b-h100", ("direct", "kvgate", "kvgate-worst", "vllm-queue")),
    ("mixed-generous-8b-h100", ("direct", "kvgate", "kvgate-worst", "vllm-queue")),
    ("deadline-8b-h100", ("direct", "kvgate")),
]
# Pools of engines (loadtests/pool.py): the arms and the checks come from each scenario's pool: block.
POOL_PLAN: list[str] = [
    "pool-burst-8b-h100",
    "pool-overload-8b-h100",
    "pool-hetero-8b-h100",
    "pool-fault-8b-h100",
]
NATURAL = ("chat-natural-8b-h100", "mixed-generous-8b-h100")
PLAN_CAPS = (64, 128, 192, 256, 320, 384, 448, 512, 100_000)  # 100,000: no cap at all
CLOSED_LOOP_LEVELS = (64, 128, 192, 256, 288, 320, 352, 384, 448)


def _check(ok: bool, text: str) -> str:
    return f"- **{'PASS' if ok else 'FAIL'}**: {text}"


def burst_checks(
    res: list[compare.ArmResult], best: dict[str, Any] | None, bound: dict[str, Any] | None = None
) -> list[str]:
    by = {r.arm: r for r in res}
    d, g = by["direct"].summary, by["kvgate"].summary
    lines = [
        _check(d["oom_crashes"] >= 1, f"direct: the burst crashes the simulated engine ({d['oom_crashes']} OOM)"),
        _check(g["oom_crashes"] == 0, f"through kvgate: {g['oom_crashes']} OOM crashes"),
        _check(g["preemptions"] == 0, f"through kvgate: {g['preemptions']:.0f} preemptions"),
        _check(g["peak_kv_usage"] <= 0.90, f"through kvgate: peak sampled KV usage {g['peak_kv_usage']:.3f} <= 0.90"),
    ]
    rejected_ok = all(r.ok or (r.status in (429, 503) and r.retry_after is not None) for r in by["kvgate"].records)
    lines.append(_check(rejected_ok, "through kvgate: every request served, or rejected with 429/503 + Retry-After"))
    if best is not None:
        ratio = g["output_tok_per_s"] / best["output_tok_per_s"]
        lines.append(
            _check(
                ratio >= 0.9,
                f"through kvgate: output throughput (whole run) {g['output_tok_per_s']:,.0f} tok/s = "
                f"{ratio:.0%} of the engine's best stable throughput {best['output_tok_per_s']:,.0f} tok/s "
                f"({best['source']}, concurrency {best['concurrency']}; the higher of the HTTP and in-process "
                "sweeps in the burst-8b-h100 section)",
            )
        )
    if bound is not None and bound["best_stable"] is not None:
        b = bound["best_stable"]
        vs_sweep = f"{b['output_tok_per_s'] / best['output_tok_per_s']:.0%} of the sweep's figure" if best else "–"
        lines.append(
            f"- for reference (not the issue's criterion): the same requests through the engine model under the "
            f"best stable FIFO concurrency cap ({b['cap']}), no HTTP: {b['output_tok_per_s']:,.0f} tok/s whole "
            f"run ({b['makespan_s']:.1f} s makespan; {vs_sweep}) and {b['saturated_tok_per_s']:,.0f} tok/s "
            f"while demand queued. kvgate: {g['output_tok_per_s'] / b['output_tok_per_s']:.0%} of it whole run "
            f"({g['makespan_s']:.1f} s makespan), {g['saturated_tok_per_s'] / b['saturated_tok_per_s']:.0%} "
            f"while demand queued."
        )
    return lines


def overload_checks(res: list[compare.ArmResult], sc: scenario.Scenario) -> list[str]:
    arm = {r.arm: r for r in res}["kvgate"]
    g = arm.summary
    queued = [s for s in arm.samples if s.up and s.gateway_queue == s.gateway_queue and s.gateway_queue > 0]
    idle = sum(1 for s in queued if s.running == 0)
    mean_running_q = sum(s.running for s in queued) / len(queued) if queued else float("nan")
    cap = None
    for c in range(4, 65):  # the engine's largest stable closed-loop concurrency for this shape, in-process
        row = closed_loop_capacity(sc, c)
        if row["preemptions"] or row["oom_steps"]:
            break
        cap = row
    lines = [
        _check(
            g["oom_crashes"] == 0 and g["preemptions"] == 0,
            f"through kvgate: {g['oom_crashes']} OOM, {g['preemptions']:.0f} preemptions",
        ),
        _check(
            g["time_in_80_90_frac"] > 0.5,
            f"through kvgate, KV usage was inside 80–90% for **{g['time_in_80_90_frac']:.0%}** of the run "
            f"({g['time_in_80_90_s']:.1f} s of simulated time; 'most of the time' read as > 50%); above 90% for "
            f"{g['time_above_90_s']:.1f} s",
        ),
        f"- busy: while the kvgate queue was non-empty ({len(queued)} samples) the engine ran "
        f"{mean_running_q:.1f} requests on average and none in {idle} of them; engine output while demand "
        f"queued {g['saturated_tok_per_s']:,.0f} tok/s",
    ]
    if cap is not None:
        lines[-1] += (
            f" = {g['saturated_tok_per_s'] / cap['output_tok_per_s']:.0%} of the engine's own closed-loop output "
            f"at its largest stable concurrency ({cap['concurrency']} in flight, in-process: "
            f"{cap['output_tok_per_s']:,.0f} tok/s, {cap['req_per_s']:.1f} req/s, mean KV "
            f"{cap['mean_kv_usage']:.2f})."
        )
    return lines


def build(out: Path, only: set[str] | None, keep_sweep: bool = False, reuse: bool = False) -> int:
    out.mkdir(parents=True, exist_ok=True)
    sections: dict[str, str] = {}
    best: dict[str, Any] | None = None
    bound: dict[str, Any] | None = None
    for name, arms in PLAN:
        if only is not None and name not in only:
            continue
        sc = scenario.load(HERE / "scenarios" / f"{name}.yaml")
        dest = out / name
        dest.mkdir(parents=True, exist_ok=True)
        extra: list[str] = []
        if name.startswith("burst-8b-h100"):
            # One sweep per preset and request shape: the long burst shares the short one's.
            saved = out / "burst-8b-h100" / "sweep.json"
            if name == "burst-8b-h100" and not (keep_sweep and saved.exists()):
                print(f"sweep for {name}", flush=True)
                sw = sweep(sc, dest)
            else:
                sw = json.loads(saved.read_text())
            best = reference(sw)
            if name == "burst-8b-h100":
                extra.append(sweep_table(sw))
            caps = tuple(sorted({*sc.sweep_concurrency, 136, 144, 152, 200}))
            bound = burst_bound(sc, caps)
            (dest / "bound.json").write_text(json.dumps(bound, indent=2) + "\n")
            extra.append(bound_table(bound))
        print(f"compare {name}: {', '.join(arms)}", flush=True)
        res = compare.compare(sc, arms, dest, reuse=reuse)
        plots(res, dest, name)
        if name in NATURAL:
            ref = natural.reference(sc, PLAN_CAPS, CLOSED_LOOP_LEVELS)
            (dest / "reference.json").write_text(json.dumps(ref, indent=2) + "\n")
            checks = natural.natural_checks(res, ref)
            extra.append(natural.reference_table(ref))
        elif name.startswith("deadline"):
            checks = natural.deadline_checks(res)
        elif name.startswith("burst"):
            checks = burst_checks(res, best, bound)
        else:
            checks = overload_checks(res, sc) if name.startswith("overload") else []
        body = [f"## {name}", "", sc.description.strip(), "", table(res), ""]
        if checks:
            body += ["Checks:", "", *checks, ""]
        estimate = natural.estimator_lines(res) if sc.natural else []
        if estimate and natural.estimator_plot(res, dest, name) is not None:
            body += [
                "The output estimate, per served request (reserved output from the response's "
                "`x-kvgate-expected-output-tokens`, actual from the stream's usage):",
                "",
                *estimate,
                "",
                f"![estimator error]({name}/estimator_error.png)",
                "",
            ]
        body += extra
        body += [
            f"![KV usage]({name}/kv_usage.png)",
            "",
            f"![queue depth]({name}/queue_depth.png)",
            "",
            f"![throughput]({name}/throughput.png)",
            "",
        ]
        sections[name] = "\n".join(body)
        (dest / "section.md").write_text(sections[name])
        print(sections[name], flush=True)
    for name in POOL_PLAN:
        if only is not None and name not in only:
            continue
        print(f"pool compare {name}", flush=True)
        sections[name] = pool_report.section(name, HERE / "scenarios" / f"{name}.yaml", out, reuse=reuse)
        print(sections[name], flush=True)
    # Keep sections of scenarios not re-run this time.
    names = [name for name, _ in PLAN] + POOL_PLAN
    for name in names:
        if name not in sections and (out / name / "section.md").exists():
            sections[name] = (out / name / "section.md").read_text()
    header = (HERE / "report_header.md").read_text()
    (out / "REPORT.md").write_text(header + "\n" + "\n".join(sections[n] for n in names if n in sections))
    return 0


def reference(sw: dict[str, Any]) -> dict[str, Any] | None:
    """The burst's throughput reference: the higher of the HTTP sweep's and the in-process sweep's best."""
    cands = []
    if sw.get("best_stable"):
        cands.append({**sw["best_stable"], "source": "HTTP sweep"})
    if sw.get("best_stable_in_process"):
        cands.append({**sw["best_stable_in_process"], "source": "in-process sweep"})
    return max(cands, key=lambda r: r["output_tok_per_s"]) if cands else None


def sweep_table(sw: dict[str, Any]) -> str:
    m = sw["method"]
    p, o = sw["shape"]["prompt_tokens"], sw["shape"]["max_tokens"]
    lines = [
        f"Concurrency sweep (closed loop on a fresh simulator per level; each request's prompt {p[0]:,}-{p[1]:,} "
        f"and output {o[0]}-{o[1]} tokens drawn like the burst's; clients start staggered over {m['stagger_s']:g} s; "
        f"generation tok/s measured from {m['warmup_s']:g} s after the first send to the last send of a "
        f"{m['duration_s']:g} s run, "
        f"while every client has a request in flight; spread = lowest and highest of {m['blocks']} equal parts "
        f"of that window; {m['repeats']} run(s) per level):",
        "",
        "| concurrency | output tok/s | spread (tok/s) | mean KV in window | peak KV | preemptions | OOM | stable "
        "| in-process: output tok/s | in-process: mean KV | in-process: stable |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sw["rows"]:
        ip = r["in_process"]
        ip_stable = "yes" if ip["stable"] else f"no ({ip['preemptions']} preemptions, {ip['oom_steps']} OOM steps)"
        lines.append(
            f"| {r['concurrency']} | {r['output_tok_per_s']:,.0f} | {r['min_block_tok_per_s']:,.0f}-"
            f"{r['max_block_tok_per_s']:,.0f} | {r['mean_kv_usage_in_window']:.3f} | {r['peak_kv_usage']:.3f} | "
            f"{r['preemptions']:.0f} | {r['oom_crashes']} | {'yes' if r['stable'] else 'no'} | "
            f"{ip['output_tok_per_s']:,.0f} | {ip['mean_kv_usage']:.3f} | {ip_stable} |"
        )
    best, best_ip = sw["best_stable"], sw.get("best_stable_in_process")
    lines += [
        "",
        "In-process: the same closed loop (sizes, stagger, window) through the simulator's engine without HTTP "
        "(`bound.closed_loop_capacity`); deterministic, and free of the clients' round trips.",
        "",
        (
            f"Best stable: HTTP sweep {best['output_tok_per_s']:,.0f} tok/s at concurrency {best['concurrency']}"
            if best
            else "HTTP sweep: no stable level"
        )
        + (
            f"; in-process {best_ip['output_tok_per_s']:,.0f} tok/s at concurrency {best_ip['concurrency']}."
            if best_ip
            else "; in-process: no stable level."
        ),
        "",
    ]
    return "\n".join(lines)


def bound_table(b: dict[str, Any]) -> str:
    lines = [
        "The burst itself under a FIFO concurrency cap, in-process through the simulator's engine (same "
        "requests, virtual time, no HTTP, no gateway; `loadtests/bound.py`), whole-run throughput = output "
        "tokens / makespan:",
        "",
        "| cap | output tok/s (whole run) | output tok/s while demand queued | makespan (s) | peak KV | "
        "preemptions | OOM steps | stable |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in b["rows"]:
        lines.append(
            f"| {r['cap']} | {r['output_tok_per_s']:,.0f} | {r['saturated_tok_per_s']:,.0f} | "
            f"{r['makespan_s']:.2f} | {r['peak_kv_usage']:.3f} | "
            f"{r['preemptions']} | {r['oom_steps']} | {'yes' if r['stable'] else 'no'} |"
        )
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    raise SystemExit(build(HERE / "results", None))
