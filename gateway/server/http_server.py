"""The client-facing HTTP/1.1 protocol: uvicorn's httptools protocol plus read deadlines (slowloris).

uvicorn has an idle keep-alive timeout but no limit on how long a client may take to send a request, so a
silent connection, or one that trickles a head or a body, is held forever. ``GuardedHttpProtocol`` adds:

* head deadline: a request's whole head must arrive within ``header_timeout_s`` of the connection opening
  (first request) or of its own first byte (later requests on a keep-alive connection; the idle gap before
  that byte is uvicorn's ``timeout_keep_alive``, ``keepalive_timeout_s``);
* body silence: while a request body is being received, no byte for longer than ``body_timeout_s`` ends
  it. A slow but steady body is not cut; nor is a body we are not reading (flow control paused reading, or
  ``Expect: 100-continue`` is still unanswered), since that silence is ours. This also closes a connection
  whose body ended after an early response (uvicorn's keep-alive timer, cancelled by those late bytes, is
  never re-armed, so it would stay open for good).

On expiry the connection is closed, after a ``408`` if part of a request arrived and no response to it has
started (a connection that never sent a byte is just closed, as is one whose response is under way).

Cost: one timer per connection, re-armed lazily. The hot path only stamps the time of each read and, at a
request's first byte, its head deadline; the timer, when it fires, reads where the request stands from
uvicorn's own state and re-arms itself if the deadline moved. A busy keep-alive connection costs about one
``call_at`` per ``header_timeout_s``, not one per request; nothing is cancelled per request.

httptools only: there is no h11 fallback, since it would silently drop the protection (httptools comes with
``uvicorn[standard]``, a dependency).
"""

from __future__ import annotations

import asyncio
import logging
from typing import ClassVar

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.config import ListenConfig
from gateway.server.disconnect import CONNECTION_LOSS, ConnectionLoss

log = logging.getLogger("kvgate")

_TIMEOUT_BODY = b"Request Timeout"
_NEVER = float("inf")


class GuardedHttpProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with head and body read deadlines; see the module docstring.

    The timeouts are class attributes: ``guarded_protocol(listen)`` makes a subclass carrying the configured
    values, since uvicorn builds one protocol instance per connection from the class alone.

    Where the latest request stands is read, when the timer fires, from uvicorn's own state rather than
    tracked per callback: ``on_message_begin`` gives ``self.scope`` a new dict, ``on_headers_complete`` makes
    ``self.cycle`` for that scope, ``on_message_complete`` clears ``cycle.more_body``. So the hot path overrides
    only ``data_received`` (stamp the time) and ``on_message_begin`` (start a head clock, and hand the request
    its connection's :class:`~gateway.server.disconnect.ConnectionLoss`, told in ``connection_lost``).
    """

    # Slots, not the instance dict: uvicorn's protocol already has 28 attributes, and past 30 CPython 3.11 stops
    # sharing the dict's keys, which un-specialises every ``self.x`` in uvicorn's code (~6k instructions a
    # request, measured with callgrind).
    __slots__ = ("_clock", "_extensions", "_head_deadline", "_last_read", "_loss", "_timer", "_timer_at")

    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 30.0
    first_check_s: ClassVar[float] = 10.0  # min(header, body): a body may begin right after its head

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, object],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._clock = self.loop.time
        self._head_deadline = 0.0  # loop time by which the current head must be complete
        self._last_read = 0.0  # loop time of the latest data_received
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = _NEVER  # when it fires
        self._loss: ConnectionLoss | None = None  # the connection's drop, told to the request in progress
        self._extensions: dict[str, dict[object, object]] = {}  # every request's scope["extensions"]

    # --- hot path: stamp, never cancel ---------------------------------------------------------------
    # (_base_x(self), not super().x(): zero-argument super() costs ~0.6 us a call, a class attribute ~0.1 us)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._loss = ConnectionLoss(self.flow.resume_reading)
        self._extensions = {CONNECTION_LOSS: {"loss": self._loss}}
        self._last_read = self._clock()
        self._head_deadline = self._last_read + self.header_timeout_s
        self._schedule(self._last_read + self.first_check_s)

    def data_received(self, data: bytes) -> None:
        self._last_read = self._clock()
        _base_data_received(self, data)

    def on_message_begin(self) -> None:
        _base_on_message_begin(self)
        self.scope["extensions"] = self._extensions
        if self.cycle is not None:  # a later request: its head clock starts at its first byte
            start = self._last_read
            self._head_deadline = start + self.header_timeout_s
            if self._timer_at > start + self.first_check_s:  # else the pending timer fires first and re-checks
                self._schedule(start + self.first_check_s)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._loss is not None:
            self._loss.lost()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # --- the timer ----------------------------------------------------------------------------------

    def _schedule(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._on_timer)
        self._timer_at = when

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = _NEVER
        if self.transport.is_closing():
            return
        now = self._clock()
        cycle = self.cycle
        in_body = cycle is not None and cycle.scope is self.scope  # the latest request's head is complete
        if in_body:
            if not cycle.more_body:
                return  # wholly received: the response takes as long as it takes; on_message_begin re-arms
            if self.flow.read_paused or cycle.waiting_for_100_continue:
                deadline = now + self.body_timeout_s  # we are not reading: the silence is ours
            else:
                deadline = self._last_read + self.body_timeout_s
        elif cycle is not None and not cycle.response_complete:
            deadline = now + self.header_timeout_s  # a pipelined head behind a response still owed
        else:
            deadline = self._head_deadline
        if now < deadline:
            self._schedule(deadline)
            return
        self._expire(in_body)

    def _expire(self, in_body: bool) -> None:
        """Close the connection; first answer 408 if part of a request came and no response to it began."""
        log.debug("closing %s: request %s not received in time", self.client, "body" if in_body else "head")
        answer = self.scope is not None  # else not a byte of a request came
        if in_body:
            cycle = self.cycle
            answer = not cycle.response_started
            cycle.disconnected = True  # the app, waiting in receive(), sees http.disconnect and sends nothing
            cycle.message_event.set()
        if answer:
            self.transport.write(self._timeout_response())
        self.transport.close()

    def _timeout_response(self) -> bytes:
        content = [STATUS_LINE[408]]
        for name, value in self.server_state.default_headers:
            content += [name, b": ", value, b"\r\n"]
        content += [
            b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: %d\r\n" % len(_TIMEOUT_BODY),
            b"connection: close\r\n\r\n",
            _TIMEOUT_BODY,
        ]
        return b"".join(content)

    # --- upgrades -----------------------------------------------------------------------------------

    def _unsupported_upgrade_warning(self) -> None:
        """An ``Upgrade`` request (websocket, h2c) is served as plain HTTP (``ws="none"``), but uvicorn drops
        whatever followed its head in the same read (a body, a pipelined request), so the connection may be
        out of step: close it once the response is sent. Logged at debug only: any client can send one, and
        uvicorn's warning would recommend installing a websocket library."""
        if self.cycle is not None:
            self.cycle.keep_alive = False
        log.debug("Upgrade request served as plain HTTP; the connection closes after the response")


_base_data_received = HttpToolsProtocol.data_received
_base_on_message_begin = HttpToolsProtocol.on_message_begin


def guarded_protocol(listen: ListenConfig) -> type[GuardedHttpProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, with ``listen``'s head and body timeouts."""

    class ConfiguredHttpProtocol(GuardedHttpProtocol):
        __slots__ = ()
        header_timeout_s = listen.header_timeout_s
        body_timeout_s = listen.body_timeout_s
        first_check_s = min(listen.header_timeout_s, listen.body_timeout_s)

    return ConfiguredHttpProtocol
