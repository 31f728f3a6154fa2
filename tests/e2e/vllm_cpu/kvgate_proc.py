"""Start and stop a real ``kvgate serve`` process in front of an engine, on a free 127.0.0.1 port.

It runs as ``python -m gateway`` from the repository root with the suite's interpreter, so it needs no
installed console script, and it is stopped like the engine: whole process group, SIGTERM then SIGKILL.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from .procs import ManagedProcess, free_port, http_status

REPO = Path(__file__).resolve().parents[3]


class Kvgate:
    """One gateway process; ``config`` is the YAML config as a dict, ``tokenizer`` the --tokenizer spec."""

    def __init__(self, upstream: str, config: dict[str, Any] | None = None, tokenizer: str | None = None) -> None:
        self.upstream = upstream
        self.config = config or {}
        self.tokenizer = tokenizer
        self.port = 0
        self.process: ManagedProcess | None = None
        self._config_file: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> Kvgate:
        """Start and wait for /readyz (200 only once the engine's metrics have been scraped)."""
        fd, name = tempfile.mkstemp(prefix="kvgate-e2e-", suffix=".yaml")
        with os.fdopen(fd, "w") as handle:
            yaml.safe_dump(self.config, handle)
        self._config_file = Path(name)
        self.port = free_port()
        argv = [
            sys.executable, "-m", "gateway", "serve",
            "--upstream", self.upstream,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--config", name,
        ]  # fmt: skip
        if self.tokenizer:
            argv += ["--tokenizer", self.tokenizer]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        log = Path(tempfile.gettempdir()) / f"kvgate-e2e-{self.port}.log"
        self.process = ManagedProcess("kvgate", argv, env, log, cwd=REPO)
        self.process.start()
        self.process.wait_until(lambda: http_status(f"{self.base_url}/readyz") == 200, timeout_s, "ready")
        return self

    def readyz(self) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(f"{self.base_url}/readyz", timeout=5) as response:
            body: dict[str, Any] = json.loads(response.read())
            return body

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a ``kvgate_`` series over the samples whose labels include ``labels``."""
        import urllib.request

        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
            text = response.read().decode()
        total = 0.0
        for line in text.splitlines():
            series, _, value = line.rpartition(" ")
            metric, _, label_text = series.partition("{")
            if metric != name:
                continue
            if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
                total += float(value)
        return total

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        if self._config_file is not None:
            self._config_file.unlink(missing_ok=True)

    def __enter__(self) -> Kvgate:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
