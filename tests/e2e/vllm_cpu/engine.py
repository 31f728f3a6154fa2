"""Start and stop a real vLLM CPU engine serving the tiny model on a free 127.0.0.1 port.

From pytest: ``with VllmEngine(blocks=256) as engine: engine.base_url ...``.
By hand, from the repository root (any python; the engine itself runs in the venv that setup.sh builds)::

    python3 -m tests.e2e.vllm_cpu.engine run [--blocks 256] [--port 8000] [-- EXTRA_VLLM_ARGS]   # foreground
    python3 -m tests.e2e.vllm_cpu.engine up [--blocks 256] [-- EXTRA_VLLM_ARGS]   # background, prints URL
    python3 -m tests.e2e.vllm_cpu.engine down                                     # stops what `up` started

Flags that matter on these CPU machines (see docs/vllm-cpu.md): ``--kv-cache-memory-bytes`` because vLLM's
default sizing reads NUMA node 0 and fails; ``--num-gpu-blocks-override`` to size the KV pool exactly, which
is what makes saturation reproducible; ``--block-size 128`` (the CPU default) and ``--enforce-eager`` (no
torch.compile: faster start, no measurable loss on this model).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from types import TracebackType

from tests.support.procs import REPO, Proc, free_port, kill_tree

MODEL_NAME = "tiny-llama"
# The tiny model: 2 layers x (K and V) x 2 KV heads x head_dim 32 x 2 bytes (bf16) per token.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 2
START_TIMEOUT_S = float(os.environ.get("KVGATE_VLLM_START_TIMEOUT_S", "300"))


def root_dir() -> Path:
    """Where setup.sh builds: ``$KVGATE_VLLM_CPU_DIR``, default ``<repo>/.vllm-cpu``."""
    return Path(os.environ.get("KVGATE_VLLM_CPU_DIR", REPO / ".vllm-cpu"))


def venv_python() -> Path:
    return root_dir() / "venv" / "bin" / "python"


def model_dir() -> Path:
    return root_dir() / MODEL_NAME


def missing() -> str | None:
    """Why the engine cannot be started here (None when setup.sh has been run)."""
    if not (root_dir() / "venv" / ".kvgate-vllm-cpu-built").exists():
        return f"vLLM CPU env not built at {root_dir() / 'venv'}: run `bash tests/e2e/vllm_cpu/setup.sh`"
    if not (model_dir() / ".kvgate-tiny-llama-built").exists():
        return f"tiny model not built at {model_dir()}: run `bash tests/e2e/vllm_cpu/setup.sh`"
    return None


def engine_env() -> dict[str, str]:
    """The environment for the engine: offline, CPU target, and no variable that overrides our KV sizing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "CUDA_"))}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_LOGGING_LEVEL=os.environ.get("KVGATE_VLLM_LOGGING_LEVEL", "INFO"),
        PYTHONUNBUFFERED="1",
    )
    # vLLM warns about the fd limit below 65536 and raises it itself where allowed; nothing to do here.
    return env


class VllmEngine:
    """One vLLM OpenAI API server process (plus its EngineCore and Worker children)."""

    def __init__(
        self,
        blocks: int = 256,
        block_size: int = 128,
        max_model_len: int = 2048,
        max_num_seqs: int = 64,
        extra_args: tuple[str, ...] = (),
        port: int | None = None,
        name: str = "vllm",
    ) -> None:
        minimum = math.ceil(max_model_len / block_size) + 1
        if blocks < minimum:
            raise ValueError(f"vLLM needs >= ceil(max_model_len/block_size)+1 = {minimum} blocks, got {blocks}")
        self.blocks = blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.extra_args = extra_args
        self.requested_port = port
        self.name = name
        self.port = 0
        self.process: Proc | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self, port: int) -> list[str]:
        # --kv-cache-memory-bytes must cover the override; extra room is harmless (the override caps it).
        kv_bytes = max(64 * 2**20, 2 * self.blocks * self.block_size * KV_BYTES_PER_TOKEN)
        return [
            str(venv_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1",
            "--port", str(port),
            "--model", str(model_dir()),
            "--served-model-name", MODEL_NAME,
            "--tokenizer", str(model_dir()),
            "--dtype", "bfloat16",
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--block-size", str(self.block_size),
            "--kv-cache-memory-bytes", str(kv_bytes),
            "--num-gpu-blocks-override", str(self.blocks),
            "--enforce-eager",
            "--disable-uvicorn-access-log",
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout_s: float = START_TIMEOUT_S) -> VllmEngine:
        """Start on a free port and wait for /health; retries on a lost port race."""
        reason = missing()
        if reason:
            raise RuntimeError(reason)
        for attempt in range(3):
            self.port = self.requested_port or free_port()
            log = root_dir() / "logs" / f"{self.name}-{self.port}.log"
            # a 15 s grace: the API server stops its EngineCore and Worker before it exits
            self.process = Proc(
                self.name, self.argv(self.port), url=self.base_url, env=engine_env(), log_path=log, grace_s=15.0
            )
            try:
                self.process.start().wait_ready("/health", timeout_s)
                return self
            except RuntimeError:
                self.process.stop()
                if (
                    attempt < 2
                    and self.requested_port is None
                    and "address already in use" in (self.process.log_tail(80).lower())
                ):
                    continue
                raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def __enter__(self) -> VllmEngine:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _state_file() -> Path:
    return root_dir() / "engine-up.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["run", "up", "down"])
    parser.add_argument("--blocks", type=int, default=256, help="KV blocks (--num-gpu-blocks-override)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)

    if args.action == "down":
        state_path = _state_file()
        if not state_path.exists():
            print("no engine started with `up`")
            return 0
        state = json.loads(state_path.read_text())
        kill_tree(state["pid"], pgid=state["pid"])
        state_path.unlink()
        print(f"stopped engine pid {state['pid']} ({state['url']})")
        return 0

    engine = VllmEngine(
        blocks=args.blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        extra_args=tuple(extra),
        port=args.port,
    )
    if args.action == "up" and _state_file().exists():
        print(f"an engine is already up ({_state_file().read_text().strip()}); run `down` first")
        return 1
    t0 = time.monotonic()
    engine.start()
    assert engine.process is not None
    if args.action == "up":  # before printing: a closed stdout must not lose track of the engine
        _state_file().write_text(json.dumps({"pid": engine.process.pid, "url": engine.base_url}) + "\n")
    print(f"vLLM ready at {engine.base_url} (model {MODEL_NAME}) in {time.monotonic() - t0:.0f} s", flush=True)
    print(f"log: {engine.process.log_path}", flush=True)
    if args.action == "up":
        print("stop it with: python3 -m tests.e2e.vllm_cpu.engine down")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while engine.process.running():
            time.sleep(1)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
