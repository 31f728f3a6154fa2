"""Start and stop real server processes for the e2e tests, and always clean up the whole process tree.

The vLLM engine forks an EngineCore and a Worker process; killing only the API server would leave ~1.3 GB
of orphans binding a core. Every process is therefore started in its own session (process group), and stop
signals the group *and* every descendant found in /proc, first SIGTERM, then SIGKILL.

Standard library only, so it runs under any interpreter (the test suite's or the engine venv's).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # comm may contain spaces and parentheses: the fields after the last ')' are fixed.
        fields = stat[stat.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children, grandchildren, ...)."""
    children = _children_map()
    found: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] != "Z"


def kill_tree(
    pid: int, pgid: int | None = None, grace_s: float = 15.0, reap: Callable[[], object] | None = None
) -> None:
    """SIGTERM the process group and all descendants of ``pid``, then SIGKILL whatever is left.

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


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of a GET, or None if nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, urllib.error.URLError):
        return None


class ManagedProcess:
    """A server process in its own session, logging to a file, that is stopped with its whole tree."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.cwd = cwd
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} not started"
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll ``ready`` until true; fail early, with the log tail, if the process dies."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running():
                raise RuntimeError(
                    f"{self.name} exited (rc={self.proc and self.proc.returncode}) before {what}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if ready():
                return
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"{self.name} not {what} after {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        kill_tree(self.proc.pid, pgid=self.proc.pid, reap=self.proc.poll)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
