"""A client that goes away cancels its request, once its body is in, whichever way the server tells of it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.server.disconnect import CONNECTION_LOSS, ConnectionLoss, DisconnectWatch, connection_loss


class Response:
    finished = False


def no_receive() -> Any:
    raise AssertionError("with a ConnectionLoss, nothing waits in receive()")


async def serve(watch: DisconnectWatch, until: asyncio.Event) -> None:
    watch.start()
    try:
        await until.wait()
    finally:
        watch.stop()


async def test_a_lost_connection_cancels_the_request_it_carries() -> None:
    resumed: list[bool] = []
    loss = ConnectionLoss(lambda: resumed.append(True))
    response = Response()
    watch = DisconnectWatch(no_receive, lambda: response.finished, loss)
    task = asyncio.create_task(serve(watch, asyncio.Event()))
    await asyncio.sleep(0)
    assert loss.watch is watch and resumed == [True]  # reading resumed: the drop can be seen
    loss.lost()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert watch.fired and loss.watch is None


async def test_a_connection_lost_after_the_whole_response_cancels_nothing() -> None:
    loss = ConnectionLoss(lambda: None)
    response = Response()
    watch = DisconnectWatch(no_receive, lambda: response.finished, loss)
    done = asyncio.Event()
    task = asyncio.create_task(serve(watch, done))
    await asyncio.sleep(0)
    response.finished = True
    loss.lost()
    done.set()
    await task
    assert not watch.fired


async def test_a_connection_lost_while_the_body_was_read_cancels_at_the_next_await() -> None:
    loss = ConnectionLoss(lambda: None)
    loss.lost()
    watch = DisconnectWatch(no_receive, lambda: False, loss)
    with pytest.raises(asyncio.CancelledError):
        await serve(watch, asyncio.Event())
    assert watch.fired


async def test_a_finished_request_leaves_the_connection_to_the_next_one() -> None:
    loss = ConnectionLoss(lambda: None)
    first = DisconnectWatch(no_receive, lambda: True, loss)
    done = asyncio.Event()
    done.set()
    await serve(first, done)
    assert loss.watch is None
    second = DisconnectWatch(no_receive, lambda: False, loss)
    task = asyncio.create_task(serve(second, asyncio.Event()))
    await asyncio.sleep(0)
    first.stop()  # a late stop of the earlier request does not unhook the later one
    assert loss.watch is second
    loss.lost()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert second.fired and not first.fired


async def test_without_the_extension_a_watcher_task_takes_receive_and_ends_with_the_response() -> None:
    """Any other ASGI server: the watcher waits in receive(); a complete response wakes it with
    http.disconnect, and it ends by itself, cancelling nothing."""
    response = Response()
    wake = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await wake.wait()
        return {"type": "http.disconnect"}

    watch = DisconnectWatch(receive, lambda: response.finished)
    done = asyncio.Event()
    task = asyncio.create_task(serve(watch, done))
    await asyncio.sleep(0)
    response.finished = True
    wake.set()
    done.set()
    await task
    watcher = watch._task
    assert watcher is not None
    await watcher
    assert not watcher.cancelled() and not watch.fired


async def test_without_the_extension_a_disconnect_cancels_the_request() -> None:
    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    watch = DisconnectWatch(receive, lambda: False)
    with pytest.raises(asyncio.CancelledError):
        await serve(watch, asyncio.Event())
    assert watch.fired


def test_the_scope_extension_is_found_or_not() -> None:
    loss = ConnectionLoss(lambda: None)
    assert connection_loss({"extensions": {CONNECTION_LOSS: {"loss": loss}}}) is loss
    assert connection_loss({"extensions": {}}) is None
    assert connection_loss({}) is None
