"""Start and stop the real server processes a run needs (simulator, gateway) on free 127.0.0.1 ports."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Proc:
    """A child process with its base URL and log file."""

    popen: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 10.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def wait_ready(proc: Proc, path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.url} exited with {proc.popen.returncode}:\n{proc.log()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(proc.url + path, timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{proc.url}{path} not ready after {timeout}s:\n{proc.log()[-3000:]}")


@contextlib.contextmanager
def spawn(argv: Sequence[str], port: int, log_path: Path, ready_path: str, timeout: float = 30.0) -> Iterator[Proc]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    proc = Proc(popen, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_ready(proc, ready_path, timeout)
        yield proc
    finally:
        proc.stop()


def sim_argv(port: int, args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "gateway.sim", "--host", "127.0.0.1", "--port", str(port), *args]


@contextlib.contextmanager
def start_sim(args: Sequence[str], log_path: Path) -> Iterator[Proc]:
    port = free_port()
    with spawn(sim_argv(port, args), port, log_path, "/health") as proc:
        yield proc


@contextlib.contextmanager
def start_gateway(upstream: str, config: Path, log_path: Path, tokenizer: str = "heuristic") -> Iterator[Proc]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "gateway",
        "serve",
        "--upstream",
        upstream,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--config",
        str(config),
        "--tokenizer",
        tokenizer,
    ]
    with spawn(argv, port, log_path, "/readyz", timeout=60.0) as proc:
        yield proc
