"""Request paths as kvgate decides on them: the canonical form (nothing to decode or normalise), kvgate's
own endpoints and the engine routes it serves (:mod:`gateway.protocol.routes` decides on them). The bottom
layer, so that the config can check its allow-list by the same rules and tables routing uses."""

from __future__ import annotations

from typing import Literal

# kvgate's own endpoints, answered before any route of the engine's (never forwarded).
CONTROL_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})

# How a generation route's body is read for its cost (see gateway.protocol.bodies).
BodyKind = Literal["chat", "completions", "responses", "messages", "invocations", "pooling", "score", "audio"]

GENERATION: dict[str, BodyKind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/invocations": "invocations",
    "/v1/embeddings": "pooling",
    "/pooling": "pooling",
    "/classify": "pooling",
    "/score": "score",
    "/v1/score": "score",
    "/rerank": "score",
    "/v1/rerank": "score",
    "/v2/rerank": "score",
    "/v1/audio/transcriptions": "audio",
    "/v1/audio/translations": "audio",
}
READ_ONLY: dict[str, frozenset[str]] = {
    "/v1/models": frozenset({"GET"}),
    "/tokenize": frozenset({"POST"}),
    "/detokenize": frozenset({"POST"}),
    "/version": frozenset({"GET"}),
    "/health": frozenset({"GET"}),
    "/ping": frozenset({"GET", "POST"}),
    "/load": frozenset({"GET"}),
}


def is_canonical(path: str) -> bool:
    """An absolute path with nothing to decode or normalise: no ``%``, no empty, ``.`` or ``..`` segment, no
    trailing slash, no ``\\``, printable ASCII only."""
    if not path.startswith("/") or path == "/":
        return path == "/"
    if any(c in path for c in "%\\?#") or not path.isascii() or not path.isprintable():
        return False
    return all(segment not in ("", ".", "..") for segment in path[1:].split("/"))
