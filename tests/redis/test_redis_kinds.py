"""What kvgate does with a Redis that answers but cannot serve it: a read-only replica (after a failover, or a
URL that names the wrong node) is not "back" until it takes writes, and a Redis Cluster, which refuses the
scripts' several keys in one call, stops start-up with the reason instead of flapping between down and up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.config import RedisConfig
from gateway.tenants.redis_store import RedisState, RedisUnavailable, RedisUnsupported
from tests.redis.conftest import RedisServer
from tests.support.procs import free_port

pytestmark = pytest.mark.redis


async def test_a_read_only_replica_is_down_until_it_is_promoted(
    redis_servers: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    primary = redis_servers()
    replica = redis_servers("--replicaof", "127.0.0.1", str(primary.port))
    state = RedisState(RedisConfig(url=replica.url, timeout_s=0.5, reconnect_interval_s=0.1))
    with caplog.at_level(logging.WARNING, logger="kvgate"):
        await state.start()
        try:
            assert not state.healthy  # it answers PING, but refuses every script's writes
            assert any("read only replica" in r.getMessage() for r in caplog.records)
            with pytest.raises(RedisUnavailable):
                await state.acquire("k", 4, "m")
            await asyncio.sleep(0.5)
            assert not state.healthy  # the probe keeps it down, rather than calling it back at each PING
            await replica_promoted(replica)
            for _ in range(100):  # the probe runs every 0.1 s
                if state.healthy:
                    break
                await asyncio.sleep(0.05)
            assert state.healthy
            assert await state.acquire("k", 4, "m")
        finally:
            await state.close()


async def replica_promoted(server: RedisServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"REPLICAOF NO ONE\r\n")
    await writer.drain()
    assert (await reader.readline()).startswith(b"+OK")
    writer.close()


async def test_a_redis_cluster_stops_start_up_with_the_reason(
    redis_servers: Callable[..., RedisServer], tmp_path: Path
) -> None:
    # the cluster bus port named: derived from a free port above 55535 it would be past 65535
    nodes, bus = str(tmp_path / "nodes.conf"), str(free_port())
    cluster = redis_servers("--cluster-enabled", "yes", "--cluster-config-file", nodes, "--cluster-port", bus)
    state = RedisState(RedisConfig(url=cluster.url, timeout_s=0.5))
    try:
        with pytest.raises(RedisUnsupported, match="Redis Cluster"):
            await state.start()
    finally:
        await state.close()
