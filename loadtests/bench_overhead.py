"""Gateway overhead: the same requests sent direct and through kvgate, side by side in one run.

Both arms hit the same fast local upstream (tests/support/mini_vllm.py, no token delay). The arms are
interleaved and repeated (direct, gateway, gateway, direct, ...) so drift on a noisy machine hits both
alike. Reported per (mode, concurrency): p50/p99 latency of each arm, the difference ("added"), and the
gateway process's CPU time per request read from /proc (steadier than latency on a shared machine).

Two CPU layouts. ``shared``: client, engine and gateway float over all cores, so on a small machine every
CPU millisecond the gateway spends is taken from the client and the engine, and at high concurrency the
added latency is mostly that contention (Little's law), not time spent inside the gateway. ``pinned``: the
gateway gets a core of its own and the client and the engine share the others, as in production where the
sidecar has its own CPU request and the engine its own cores.

    python3 -m loadtests.bench_overhead                # full run: c=1,32,128, stream and non-stream, both layouts
    python3 -m loadtests.bench_overhead --quick        # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from tests.support.procs import start_gateway, start_mini_vllm

CLK_TCK = os.sysconf("SC_CLK_TCK")


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (sched_setaffinity applies per thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def layouts(requested: str) -> dict[str, tuple[set[int], set[int]]]:
    """layout -> (cores of client and engine, cores of the gateway)."""
    cores = sorted(os.sched_getaffinity(0))
    out: dict[str, tuple[set[int], set[int]]] = {}
    if requested in ("shared", "both"):
        out["shared"] = (set(cores), set(cores))
    if requested in ("pinned", "both") and len(cores) >= 2:
        out["pinned"] = (set(cores[:-1]), {cores[-1]})
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its threads, from /proc (the gateway's tokenizer threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class Arm:
    latencies: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    requests: int = 0
    errors: int = 0


async def run_arm(url: str, body: bytes, stream: bool, concurrency: int, n: int, arm: Arm, pid: int | None) -> None:
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        todo = iter(range(n))

        async def worker() -> None:
            for _ in todo:
                t0 = time.perf_counter()
                async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
                    if stream:
                        async for _chunk in resp.content.iter_any():
                            pass
                    else:
                        await resp.read()
                    if resp.status != 200:
                        arm.errors += 1
                arm.latencies.append(time.perf_counter() - t0)

        cpu0 = cpu_seconds(pid) if pid else 0.0
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        arm.cpu_s += (cpu_seconds(pid) if pid else 0.0) - cpu0
        arm.requests += n


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench(args: argparse.Namespace) -> str:
    rows = []
    with (
        start_mini_vllm(num_blocks=100000, block_size=16, token_delay_ms=0) as upstream,
        start_gateway(upstream.url, {"tokenizer": "heuristic", "log_level": "warning"}) as gw,
    ):
        for layout, (others, gateway_cores) in layouts(args.layout).items():
            pin(os.getpid(), others)
            pin(upstream.pid, others)
            pin(gw.pid, gateway_cores)
            rows += await _layout_rows(args, layout, upstream.url, gw.url, gw.pid)
    return _table(rows, args)


async def _layout_rows(
    args: argparse.Namespace, layout: str, upstream: str, gw: str, gw_pid: int
) -> list[dict[str, float | int | str]]:
    rows: list[dict[str, float | int | str]] = []
    for stream in (False, True):
        body = orjson.dumps({"model": "mini", "prompt": "Hello " * 20, "max_tokens": args.tokens, "stream": stream})
        for concurrency in args.concurrency:
            n = max(args.requests, concurrency * 4)
            direct, via = Arm(), Arm()
            # warm both paths (connection pools, tokenizer caches)
            await run_arm(upstream + "/v1/completions", body, stream, concurrency, concurrency, Arm(), None)
            await run_arm(gw + "/v1/completions", body, stream, concurrency, concurrency, Arm(), None)
            for r in range(args.rounds):
                order = [(upstream, direct, None), (gw, via, gw_pid)]
                for url, arm, pid in order if r % 2 == 0 else reversed(order):
                    await run_arm(url + "/v1/completions", body, stream, concurrency, n, arm, pid)
            row: dict[str, float | int | str] = {
                "layout": layout,
                "mode": "stream" if stream else "non-stream",
                "c": concurrency,
                "n": via.requests,
                "direct_p50": pct(direct.latencies, 0.5) * 1e3,
                "direct_p99": pct(direct.latencies, 0.99) * 1e3,
                "gw_p50": pct(via.latencies, 0.5) * 1e3,
                "gw_p99": pct(via.latencies, 0.99) * 1e3,
                "cpu_ms": via.cpu_s / via.requests * 1e3,
                "errors": direct.errors + via.errors,
            }
            rows.append(row)
            print(_fmt(row), flush=True)
    return rows


def _fmt(r: dict[str, float | int | str]) -> str:
    return (
        f"| {r['layout']} | {r['mode']} | {r['c']} | {r['n']} | {r['direct_p50']:.2f} | {r['gw_p50']:.2f} | "
        f"{float(r['gw_p50']) - float(r['direct_p50']):+.2f} | {r['direct_p99']:.2f} | {r['gw_p99']:.2f} | "
        f"{float(r['gw_p99']) - float(r['direct_p99']):+.2f} | {r['cpu_ms']:.3f} | {r['errors']} |"
    )


def _table(rows: list[dict[str, float | int | str]], args: argparse.Namespace) -> str:
    head = (
        f"Responses of {args.tokens} tokens from a zero-delay upstream; {args.rounds} interleaved rounds per cell; "
        f"latencies in ms; CPU = gateway process CPU ms per request.\n\n"
        "| layout | mode | concurrency | requests/arm | direct p50 | kvgate p50 | added p50 | direct p99 | "
        "kvgate p99 | added p99 | kvgate CPU ms/req | errors |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    return head + "\n".join(_fmt(r) for r in rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000, help="requests per arm per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16, help="tokens per response (SSE events when streaming)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--layout", choices=["shared", "pinned", "both"], default="both", help="CPU layout(s), see above")
    p.add_argument("--quick", action="store_true", help="200 requests, 2 rounds")
    p.add_argument("--out", type=Path, help="write the markdown table here")
    args = p.parse_args()
    if args.quick:
        args.requests, args.rounds = 200, 2
    table = asyncio.run(bench(args))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
