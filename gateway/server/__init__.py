"""The client side: the ASGI application and the request path.

Owns: :mod:`.app` (wiring, routing, lifecycle, control endpoints), :mod:`.request_path` (one request, top to
bottom), :mod:`.exchange` (one object per request: slot, reservation, charge, progress, released and settled
once), :mod:`.response` (the ASGI response writer), :mod:`.disconnect`, :mod:`.serve` (uvicorn with draining),
:mod:`.http_server` and :mod:`.http_cycle` (the client-facing HTTP/1.1 protocol uvicorn runs).
May import every other subpackage; nothing imports it but :mod:`gateway.cli`.
"""
