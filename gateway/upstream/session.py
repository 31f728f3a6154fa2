"""The aiohttp session shared by kvgate's own calls to the engine (scrapes, /v1/models, /tokenize).

aiohttp binds a session to the running event loop, which exists only once the server runs; the parts that use
it are built before that. So they share this handle, which opens the session on first use and closes it once.
"""

from __future__ import annotations

import aiohttp

from gateway.upstream.http_client import KEEPALIVE_S


class UpstreamSession:
    def __init__(self, max_connections: int) -> None:
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def __call__(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
