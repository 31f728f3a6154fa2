"""Fixtures that start real simulator processes on free 127.0.0.1 ports and always stop them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.support.procs import Proc, start_sim

StartSim = Callable[..., Proc]


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[StartSim]:
    """``sim("--kv-scale", "0.02", ...)`` starts a simulator; all are stopped at teardown."""
    with ExitStack() as stack:
        count = 0

        def start(*args: str) -> Proc:
            nonlocal count
            count += 1
            return stack.enter_context(start_sim(list(args), tmp_path / f"sim{count}.log"))

        yield start
