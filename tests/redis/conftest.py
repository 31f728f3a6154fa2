"""A real ``redis-server`` on a free loopback port (never a fake), that a test can kill and restart."""

from __future__ import annotations

import shutil
import signal
import socket
import tempfile
from collections.abc import Callable, Iterator

import pytest

from tests.support.procs import Proc, free_port

pytestmark = pytest.mark.redis

REDIS_SERVER = shutil.which("redis-server")


class RedisServer:
    def __init__(self, *extra: str) -> None:
        """``extra``: more of redis-server's options (``--replicaof``, ``--cluster-enabled``, ...)."""
        assert REDIS_SERVER is not None
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="kvgate-redis-")
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = Proc("redis", [*argv, "--dir", self.dir, *extra])
        self.start()

    def start(self) -> None:
        self.proc.start().wait_until(self._pong, 10, "answering PING")

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: the replicas see connections drop and nothing answer, as in a crash."""
        if self.proc.running():
            self.proc.signal(signal.SIGKILL)
            assert self.proc.popen is not None
            self.proc.popen.wait(5)

    def stop(self) -> None:
        self.kill()
        self.proc.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture
def redis_servers() -> Iterator[Callable[..., RedisServer]]:
    """``redis_servers(*options)`` starts another redis-server; all are stopped at teardown."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    started: list[RedisServer] = []

    def start(*extra: str) -> RedisServer:
        started.append(RedisServer(*extra))
        return started[-1]

    yield start
    for server in started:
        server.stop()
