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
        remove_on_stop: Sequence[Path] = (),
    ) -> None:
        self.remove_on_stop = list(remove_on_stop)
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
        for path in [Path(self.log.name), *self.remove_on_stop]:
            path.unlink(missing_ok=True)


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
    """``kvgate serve`` with ``config`` written to a temporary file (removed when the process is stopped)."""
    with tempfile.NamedTemporaryFile("w", prefix="kvgate-", suffix=".yaml", delete=False) as cfg_file:
        yaml.safe_dump(config or {}, cfg_file)
    return start_gateway_with_file(upstream, Path(cfg_file.name), ready=ready, extra_args=extra_args, owned=True)


def start_gateway_with_file(
    upstream: str, config_path: Path, *, ready: bool = True, extra_args: Sequence[str] = (), owned: bool = False
) -> tuple[Proc, str]:
    """``kvgate serve`` with a config file the caller manages (``owned``: remove it on stop)."""
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
        str(config_path),
        *extra_args,
    ]
    url = f"http://127.0.0.1:{port}"
    cleanup = [config_path] if owned else []
    return Proc(argv, url + ("/readyz" if ready else "/healthz"), remove_on_stop=cleanup), url
