"""The one way tests and load tests start real servers: kvgate, the simulator, the mini vLLM, the vLLM engine.

Each runs in its own session (process group), logs to a file, and is stopped with its whole tree: SIGTERM to
the group and every descendant found in /proc, then SIGKILL. (The vLLM engine forks an EngineCore and a
Worker; killing only the API server would leave ~1.3 GB of orphans binding a core.) Waiting for readiness
fails early, with the log tail, if the process dies.

Standard library only: ``python3 -m tests.e2e.vllm_cpu.engine`` imports it under whatever python runs it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of a GET, or None if nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        fields = _stat_fields(int(entry)) if entry.isdigit() else None
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def _group_alive(pgid: int) -> bool:
    """Whether any live process is still in process group ``pgid`` (e.g. orphans of a leader that exited)."""
    for entry in os.listdir("/proc"):
        fields = _stat_fields(int(entry)) if entry.isdigit() else None
        if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def kill_tree(
    pid: int, pgid: int | None = None, grace_s: float = 15.0, reap: Callable[[], object] | None = None
) -> None:
    """SIGTERM the process group and all descendants of ``pid``, then SIGKILL whatever is left after ``grace_s``.

    ``reap`` (e.g. ``Popen.poll``) collects ``pid`` if it is our child, so it stops counting as alive.
    """
    targets = {pid, *descendants(pid)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        targets |= set(descendants(pid)) if _alive(pid) else set()
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
        for target in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(target, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            if reap is not None:
                reap()
            if not any(_alive(t) for t in targets):
                return
            time.sleep(0.1)


class Proc:
    """One server process: own session, output in ``log_path`` (a temp file, removed on stop, if None).

    ``url`` is its base URL; ``remove_on_stop`` are files it owns (a config written for it).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        url: str = "",
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        grace_s: float = 10.0,
        remove_on_stop: Sequence[Path] = (),
        cwd: Path = REPO,
    ) -> None:
        self.name = name
        self.cwd = cwd
        self.argv = list(argv)
        self.url = url
        self.env = dict(env) if env is not None else {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.grace_s = grace_s
        self.remove_on_stop = list(remove_on_stop)
        if log_path is None:
            fd, temp = tempfile.mkstemp(prefix=f"kvgate-{name}-", suffix=".log")
            os.close(fd)
            log_path = Path(temp)
            self.remove_on_stop.append(log_path)
        self.log_path = log_path
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        """Start (again, after a stop or a crash) from ``cwd`` (the repository root), with a fresh log."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            log.write(f"=== {time.strftime('%H:%M:%S')} {' '.join(self.argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} not started"
        return self.popen.pid

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, what: str) -> Proc:
        """Poll ``ready`` until true. If the process dies first (RuntimeError) or time runs out (TimeoutError),
        stop it and raise with the log tail."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if not self.running():
                self._fail(RuntimeError, f"exited (rc={self.popen and self.popen.returncode}) before {what}")
            if time.monotonic() > deadline:
                self._fail(TimeoutError, f"not {what} after {timeout_s:.0f} s")
            time.sleep(0.05)
        return self

    def _fail(self, error: type[Exception], problem: str) -> NoReturn:
        message = f"{self.name} {problem}; log {self.log_path}:\n{self.log_tail()}"
        self.stop()
        raise error(message)

    def wait_ready(self, path: str, timeout_s: float = 30.0) -> Proc:
        """Wait until GET ``url + path`` answers 200."""
        return self.wait_until(lambda: http_status(self.url + path) == 200, timeout_s, f"answering 200 on {path}")

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process group, if it is still running."""
        if self.running():
            os.killpg(self.pid, sig)

    def stop(self) -> None:
        """Stop the whole tree (idempotent) and remove the files this process owns.

        Once the process has exited and been reaped its pid may be reused, so only a group that still has
        members (orphans hold the pgid, which keeps the pid from being reused) is signalled then."""
        if self.popen is not None and (self.popen.poll() is None or _group_alive(self.popen.pid)):
            kill_tree(self.popen.pid, pgid=self.popen.pid, grace_s=self.grace_s, reap=self.popen.poll)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=5)
        for path in self.remove_on_stop:
            path.unlink(missing_ok=True)

    def __enter__(self) -> Proc:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _local(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def start_mini_vllm(**opts: object) -> Proc:
    """``tests.support.mini_vllm``; ``opts`` become its flags (``token_delay_ms=0`` -> ``--token-delay-ms 0``)."""
    port = free_port()
    argv = [sys.executable, "-m", "tests.support.mini_vllm", "--port", str(port)]
    for key, value in opts.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return Proc("mini-vllm", argv, url=_local(port)).start().wait_ready("/health")


def start_sim(args: Sequence[str], log_path: Path | None = None) -> Proc:
    """The vLLM simulator (``python -m gateway.sim``) with ``args``."""
    port = free_port()
    argv = [sys.executable, "-m", "gateway.sim", "--host", "127.0.0.1", "--port", str(port), *args]
    return Proc("sim", argv, url=_local(port), log_path=log_path).start().wait_ready("/health")


def gateway_argv(
    upstream: str, port: int, config: Path, tokenizer: str | None = None, extra_args: Sequence[str] = ()
) -> list[str]:
    """``kvgate serve`` on 127.0.0.1:``port``, run as ``python -m gateway`` (no console script needed)."""
    argv = [sys.executable, "-m", "gateway", "serve", "--upstream", upstream, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--config", str(config)]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    return [*argv, *extra_args]


def start_gateway(
    upstream: str,
    config: Mapping[str, Any] | Path | None = None,
    *,
    tokenizer: str | None = None,
    extra_args: Sequence[str] = (),
    ready: bool = True,
    log_path: Path | None = None,
    timeout_s: float = 60.0,
    tree: Path = REPO,
) -> Proc:
    """``kvgate serve`` in front of ``upstream``, waited for until /readyz (or only /healthz: ``ready=False``).

    ``config`` is a file the caller keeps, or a dict written to a temporary file that is removed on stop.
    ``tree`` is the source tree it runs from (another checkout, to compare two builds side by side).
    """
    owned: list[Path] = []
    if not isinstance(config, Path):
        import yaml  # here, not at the top: the engine CLI imports this module under any python

        fd, name = tempfile.mkstemp(prefix="kvgate-", suffix=".yaml")
        with os.fdopen(fd, "w") as handle:
            yaml.safe_dump(dict(config or {}), handle)
        config = Path(name)
        owned.append(config)
    port = free_port()
    argv = gateway_argv(upstream, port, config, tokenizer, extra_args)
    proc = Proc("kvgate", argv, url=_local(port), log_path=log_path, remove_on_stop=owned, cwd=tree)
    return proc.start().wait_ready("/readyz" if ready else "/healthz", timeout_s)
