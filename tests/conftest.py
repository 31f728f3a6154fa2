from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.procs import Proc, start_gateway, start_mini_vllm


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Every process a test starts goes in here and is stopped afterwards, whatever the test did."""
    started: list[Proc] = []
    yield started
    for proc in reversed(started):
        proc.stop()


@pytest.fixture
def mini_vllm(procs: list[Proc]) -> Callable[..., str]:
    def start(**opts: object) -> str:
        procs.append(start_mini_vllm(**opts))
        return procs[-1].url

    return start


@pytest.fixture
def gateway(procs: list[Proc]) -> Callable[..., str]:
    def start(upstream: str, config: dict[str, object] | None = None, **kw: Any) -> str:
        procs.append(start_gateway(upstream, config, **kw))
        return procs[-1].url

    return start
