"""``python -m loadtests run|compare|sweep|report`` (see loadtests/README.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from loadtests import compare as compare_mod
from loadtests import runner, scenario
from loadtests.stats import summarize

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a scenario against any OpenAI endpoint and its vLLM /metrics")
    r.add_argument("scenario")
    r.add_argument("--target", required=True, help="base URL requests go to (vLLM or kvgate)")
    r.add_argument("--metrics", help="vLLM base URL whose /metrics is sampled (default: --target)")
    r.add_argument("--gateway-metrics", help="kvgate base URL whose /metrics is sampled for its queue")
    r.add_argument("--model", required=True)
    r.add_argument("--time-scale", type=float, default=1.0, help="the engine's time scale (1 for real vLLM)")
    r.add_argument("--out", default="loadtests/results/adhoc")
    c = sub.add_parser("compare", help="direct vs through kvgate (vs vLLM's queue limit) on fresh simulators")
    c.add_argument("scenario")
    c.add_argument("--arms", default="direct,kvgate", help=f"comma list of {', '.join(compare_mod.ARMS)}")
    c.add_argument("--out", help="default loadtests/results/<scenario name>")
    s = sub.add_parser("sweep", help="concurrency sweep: the engine's best stable throughput")
    s.add_argument("scenario")
    s.add_argument("--out", help="default loadtests/results/<scenario name>")
    pl = sub.add_parser("pool", help="a pool scenario: direct-rr / sidecar / pool-kvgate on N fresh simulators")
    pl.add_argument("scenario")
    pl.add_argument("--arms", help="comma list of direct-rr, sidecar, pool-kvgate (default: the scenario's)")
    pl.add_argument("--out", default=str(HERE / "results"), help="results directory (a folder per scenario)")
    pl.add_argument("--reuse", action="store_true", help="read back arms already saved instead of running them")
    rep = sub.add_parser("report", help="the full committed report: sweep + every scenario's compare")
    rep.add_argument("--out", default=str(HERE / "results"))
    rep.add_argument("--only", help="comma list of scenario names to (re)run")
    rep.add_argument("--keep-sweep", action="store_true", help="reuse a saved sweep.json")
    rep.add_argument("--reuse", action="store_true", help="read back arms already saved instead of running them")
    args = p.parse_args(argv)

    if args.cmd == "report":
        from loadtests.full_report import build

        return build(Path(args.out), set(args.only.split(",")) if args.only else None, args.keep_sweep, args.reuse)
    if args.cmd == "pool":
        from loadtests import pool, pool_report

        sc, _ = pool.load(args.scenario)
        arms = tuple(args.arms.split(",")) if args.arms else None
        print(pool_report.section(sc.name, Path(args.scenario), Path(args.out), reuse=args.reuse, arms=arms))
        return 0
    sc = scenario.load(args.scenario)
    out = Path(args.out) if args.out else HERE / "results" / sc.name
    out.mkdir(parents=True, exist_ok=True)
    if args.cmd == "run":
        records, samples = asyncio.run(
            runner.run(
                sc.arrivals(),
                args.target,
                args.metrics or args.target,
                model=args.model,
                time_scale=args.time_scale,
                gateway_metrics=args.gateway_metrics,
            )
        )
        summary = summarize(records, samples, sc.ttft_slo_s, oom_crashes=0)
        runner.save(out, records, samples, summary)
        print(summary)
        return 0
    if args.cmd == "sweep":
        from loadtests.sweep import sweep

        print(sweep(sc, out)["best_stable"])
        return 0
    from loadtests.report import plots, table

    results = compare_mod.compare(sc, tuple(args.arms.split(",")), out)
    md = f"## {sc.name}\n\n{sc.description}\n\n{table(results)}\n"
    plots(results, out, sc.name)
    (out / "compare.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
