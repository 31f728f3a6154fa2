"""redis.url is the one place a Redis password can go: it must not reach the logs with it."""

from __future__ import annotations

import logging

import pytest

from gateway.config import RedisConfig
from gateway.tenants.redis_store import RedisState, without_password


@pytest.mark.parametrize(
    ("url", "logged"),
    [
        ("redis://:S3cret@redis:6379/0", "redis://:***@redis:6379/0"),
        ("rediss://app:S3cret@[::1]:6380/2", "rediss://app:***@[::1]:6380/2"),
        ("redis://redis:6379/0", "redis://redis:6379/0"),
        ("redis://app@redis/0", "redis://app@redis/0"),  # a user name alone is not a secret
        ("redis://redis:6379/0?password=S3cret", "redis://redis:6379/0"),  # redis-py takes it there too
        ("unix:///var/run/redis.sock?db=0&password=S3cret", "unix:///var/run/redis.sock"),
    ],
)
def test_without_password(url: str, logged: str) -> None:
    assert without_password(url) == logged


async def test_redis_health_changes_are_logged_without_the_password(caplog: pytest.LogCaptureFixture) -> None:
    state = RedisState(RedisConfig(url="redis://:S3cret@127.0.0.1:1/0"))
    with caplog.at_level(logging.WARNING, logger="kvgate.redis"):
        state._set_health(True)
        state._set_health(False)
    assert "is back" in caplog.text and "is DOWN" in caplog.text
    assert "S3cret" not in caplog.text and ":***@127.0.0.1:1/0" in caplog.text
    await state.close()
