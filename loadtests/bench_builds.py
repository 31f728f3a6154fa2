"""Two builds of kvgate side by side: gateway CPU per request of this tree against a baseline revision.

A refactor must not cost CPU on the hot path, and a comparison across two separate runs drowns in this
machine's drift. So both builds run at once, in front of one zero-delay upstream, and their arms are
interleaved and repeated (current, baseline, baseline, current, ...); the figure is each gateway process's
CPU ms per request, read from /proc, and their ratio.

    python3 -m loadtests.bench_builds --baseline ffcfeac      # a git revision; checked out in a temp worktree
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import tempfile
from pathlib import Path

import orjson

from loadtests.bench_overhead import Arm, layouts, pin, run_arm
from tests.support.procs import REPO, start_gateway, start_mini_vllm


async def bench(args: argparse.Namespace, baseline_tree: Path, current_tree: Path) -> str:
    config = {"tokenizer": args.tokenizer, "log_level": "warning"}
    lines = [
        f"Gateway CPU ms per request, {args.current or 'this tree'} vs {args.baseline}; "
        f"{args.rounds} interleaved rounds of "
        f"{args.requests} requests per build and cell; {args.tokens}-token responses; layout {args.layout}.\n",
        "| mode | concurrency | current CPU ms/req | baseline CPU ms/req | current / baseline | errors |",
        "|---|---|---|---|---|---|",
    ]
    with (
        start_mini_vllm(num_blocks=100000, block_size=16, token_delay_ms=0) as upstream,
        start_gateway(upstream.url, config, tree=current_tree) as current,
        start_gateway(upstream.url, config, tree=baseline_tree) as baseline,
    ):
        others, gateway_cores = layouts(args.layout)[args.layout]
        pin(os.getpid(), others)
        pin(upstream.pid, others)
        pin(current.pid, gateway_cores)
        pin(baseline.pid, gateway_cores)
        for stream in (False, True):
            body = orjson.dumps({"model": "mini", "prompt": "Hello " * 20, "max_tokens": args.tokens, "stream": stream})
            for concurrency in args.concurrency:
                n = max(args.requests, concurrency * 4)
                arms = {"current": (current, Arm()), "baseline": (baseline, Arm())}
                for proc, _ in arms.values():  # warm-up
                    await run_arm(proc.url + "/v1/completions", body, stream, concurrency, concurrency, Arm(), None)
                for r in range(args.rounds):
                    order = list(arms.values()) if r % 2 == 0 else list(reversed(arms.values()))
                    for proc, arm in order:
                        await run_arm(proc.url + "/v1/completions", body, stream, concurrency, n, arm, proc.pid)
                cur, base = arms["current"][1], arms["baseline"][1]
                cur_ms, base_ms = cur.cpu_s / cur.requests * 1e3, base.cpu_s / base.requests * 1e3
                line = (
                    f"| {'stream' if stream else 'non-stream'} | {concurrency} | {cur_ms:.3f} | {base_ms:.3f} | "
                    f"{cur_ms / base_ms:.2f} | {cur.errors + base.errors} |"
                )
                print(line, flush=True)
                lines.append(line)
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="git revision to compare with")
    p.add_argument("--current", help="git revision to measure (default: the working tree as it is)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--layout", choices=["shared", "pinned"], default="pinned")
    p.add_argument(
        "--tokenizer",
        default="heuristic",
        help="both builds' tokenizer, e.g. hf:/abs/path/to/llama3-tokenizer (a path both trees can reach)",
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvgate-builds-") as tmp:
        trees = {"baseline": Path(tmp) / "baseline", "current": Path(tmp) / "current" if args.current else REPO}
        revisions = {"baseline": args.baseline, "current": args.current}
        for name, rev in revisions.items():
            if rev is not None:
                subprocess.run(
                    ["git", "worktree", "add", "-q", "--detach", str(trees[name]), rev], cwd=REPO, check=True
                )
        try:
            table = asyncio.run(bench(args, trees["baseline"], trees["current"]))
        finally:
            for name, rev in revisions.items():
                if rev is not None:
                    subprocess.run(["git", "worktree", "remove", "--force", str(trees[name])], cwd=REPO, check=False)
    if args.out:
        args.out.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
