"""Request paths as kvgate decides on them: the canonical form (nothing to decode or normalise) and kvgate's
own endpoints. The bottom layer, so that the config can check its allow-list by the same rule routing uses."""

from __future__ import annotations

# kvgate's own endpoints, answered before any route of the engine's (never forwarded).
CONTROL_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def is_canonical(path: str) -> bool:
    """An absolute path with nothing to decode or normalise: no ``%``, no empty, ``.`` or ``..`` segment, no
    trailing slash, no ``\\``, printable ASCII only."""
    if not path.startswith("/") or path == "/":
        return path == "/"
    if any(c in path for c in "%\\?#") or not path.isascii() or not path.isprintable():
        return False
    return all(segment not in ("", ".", "..") for segment in path[1:].split("/"))
