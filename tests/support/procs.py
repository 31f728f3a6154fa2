"""Start real server processes on free loopback ports, wait until they answer, and always clean them up."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process in its own process group, with its output in a temp file for failure messages."""

    def __init__(
        self,
        argv: Sequence[str],
        ready_url: str,
        *,
        env: dict[str, str] | None = None,
        ready_status: int = 200,
        timeout_s: float = 30.0,
    ) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="kvgate-test-", suffix=".log", delete=False)  # noqa: SIM115
        self.popen = subprocess.Popen(
            list(argv),
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.wait_ready(ready_url, ready_status, timeout_s)

    def wait_ready(self, url: str, status: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"process exited with {self.popen.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == status:
                        return
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
                if exc.code == status:
                    return
            except OSError as exc:
                last = str(exc)
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{url} not ready in {timeout_s}s ({last}):\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-5000:]

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(5)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def start_mini_vllm(**opts: object) -> tuple[Proc, str]:
    port = free_port()
    argv = [sys.executable, "-m", "tests.support.mini_vllm", "--port", str(port)]
    for key, value in opts.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    url = f"http://127.0.0.1:{port}"
    return Proc(argv, url + "/health"), url


def start_gateway(
    upstream: str, config: dict[str, object] | None = None, *, ready: bool = True, extra_args: Sequence[str] = ()
) -> tuple[Proc, str]:
    port = free_port()
    with tempfile.NamedTemporaryFile("w", prefix="kvgate-", suffix=".yaml", delete=False) as cfg_file:
        yaml.safe_dump(config or {}, cfg_file)
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
        cfg_file.name,
        *extra_args,
    ]
    url = f"http://127.0.0.1:{port}"
    return Proc(argv, url + ("/readyz" if ready else "/healthz")), url
