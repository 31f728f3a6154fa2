"""``kvgate sim``: command-line flags (named after vLLM's where vLLM has one) and the server's lifetime."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
from pathlib import Path

from aiohttp import web

from gateway.sim.config import PRESETS, SimConfig, preset
from gateway.sim.lengths import OutputLengths, parse_lengths
from gateway.sim.server import SimServer
from gateway.tokens.tokenizers import load_tokenizer

log = logging.getLogger("kvgate.sim")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvgate sim",
        description="A vLLM simulator that behaves like the engine "
        "under KV-cache pressure (paged blocks, preemption, CUDA OOM).",
    )
    p.add_argument("--preset", default="llama3-8b-h100", choices=sorted(PRESETS))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="model name clients must send (default: the preset's)")
    p.add_argument("--num-gpu-blocks-override", type=int, help="KV blocks (vLLM's flag of the same name)")
    p.add_argument(
        "--kv-scale",
        type=float,
        default=1.0,
        help="shrink the KV pool by this factor keeping OOM and usage thresholds (for fast tests)",
    )
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument(
        "--max-num-queued-reqs", type=int, help="reject with 503 when this many requests are unfinished (as vLLM)"
    )
    p.add_argument("--stream-interval", type=int, help="tokens per streamed event (vLLM's flag; default 1)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="real seconds per simulated second (0.1 runs ten times faster than the GPU)",
    )
    p.add_argument(
        "--oom-mode",
        choices=("restart", "exit"),
        default="restart",
        help="on a simulated CUDA OOM: fail running requests with 500 and restart, or exit(1)",
    )
    p.add_argument("--restart-delay", type=float, default=60.0, help="simulated seconds an OOM restart takes")
    p.add_argument("--no-oom", action="store_true", help="never OOM (a correctly sized deployment)")
    p.add_argument(
        "--legacy-gpu-cache-metric",
        action="store_true",
        help="also export the pre-V1 vllm:gpu_cache_usage_perc gauge",
    )
    p.add_argument(
        "--output-tokens",
        type=_lengths,
        metavar="SPEC",
        help="natural output length of requests without sim_output_tokens: N | fixed:N | A-B | uniform:A-B | "
        "lognormal:median=M,p99=P (default: none, every request runs to max_tokens)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the --output-tokens draws (vLLM's flag)")
    p.add_argument("--tokenizer", default="heuristic", help="hf:PATH | tiktoken:NAME_OR_FILE | heuristic[:N]")
    p.add_argument("--log-level", default="info")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    cfg = preset(args.preset)
    if args.num_gpu_blocks_override is not None:
        cfg = dataclasses.replace(cfg, num_gpu_blocks=args.num_gpu_blocks_override)
    cfg = cfg.scaled(args.kv_scale)
    overrides = {
        "served_model_name": args.served_model_name,
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_queued_reqs": args.max_num_queued_reqs,
        "stream_interval": args.stream_interval,
        "output_tokens": args.output_tokens,
    }
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None}, seed=args.seed)
    if args.no_oom:
        cfg = dataclasses.replace(
            cfg,
            activation_bytes_per_prefill_token=0.0,
            hardware=dataclasses.replace(cfg.hardware, hbm_bytes_per_gpu=float("inf")),
        )
    return cfg


def _lengths(spec: str) -> OutputLengths:
    try:
        return parse_lengths(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


async def serve(server: SimServer, host: str, port: int) -> int:
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, server.shutdown.set)
    cfg = server.cfg
    log.info(
        "kvgate sim serving %s on http://%s:%d: %d blocks x %d tokens, max_model_len %d, max_num_seqs %d, "
        "max_num_batched_tokens %d, time scale %g, oom mode %s, natural output lengths %s (seed %d)",
        cfg.served_model_name,
        host,
        port,
        cfg.num_gpu_blocks,
        cfg.block_size,
        cfg.max_model_len,
        cfg.max_num_seqs,
        cfg.max_num_batched_tokens,
        server.time_scale,
        server.oom_mode,
        cfg.output_tokens or "from sim_output_tokens only",
        cfg.seed,
    )
    engine_task = asyncio.create_task(server.run_engine())
    try:
        await server.shutdown.wait()
    finally:
        server.wake.set()
        engine_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await engine_task
        await runner.cleanup()
    return server.exit_code


def run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(args)
    tokenizer = load_tokenizer(args.tokenizer)
    # a vLLM started with --model DIR reports DIR and counts with its tokenizer: so does the simulator
    model_root = None
    if args.tokenizer.startswith("hf:"):
        path = Path(args.tokenizer[3:]).resolve()
        model_root = str(path.parent if path.is_file() else path)  # a tokenizer.json: its model's directory

    async def main() -> int:
        server = SimServer(
            cfg,
            tokenizer,
            time_scale=args.time_scale,
            oom_mode=args.oom_mode,
            restart_delay_s=args.restart_delay,
            legacy_gpu_cache_metric=args.legacy_gpu_cache_metric,
            model_root=model_root,
        )
        return await serve(server, args.host, args.port)

    return asyncio.run(main())
