"""Loops for the unit tests: the lean upstream client runs on both asyncio's loop and uvloop (the gateway's)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop

# Transports differ between the two in ways the client touches: pause/resume reading, read sizes, close.
_BOTH_LOOPS: Mapping[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
_DEFAULT_LOOP: Mapping[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return _BOTH_LOOPS if item.path.name == "test_http_client.py" else _DEFAULT_LOOP
