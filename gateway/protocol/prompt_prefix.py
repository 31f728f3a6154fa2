"""The leading bytes of a request's prompt: what prefix affinity (:mod:`gateway.admission.affinity`) keys on."""

from __future__ import annotations

from array import array

from gateway.protocol.requests import InferenceRequest


def leading_bytes(request: InferenceRequest, limit: int) -> bytes:
    """The first ``limit`` bytes of what the engine will see first: a chat's messages (role, then text) in
    order, or the first prompt (text, or token ids as machine integers). Non-text content parts are skipped:
    they change the prompt but this key only has to be the same for the same leading text."""
    if request.messages is not None:
        parts: list[bytes] = []
        size = 0
        for message in request.messages:
            for piece in _message_texts(message):
                data = _head(piece, limit - size)  # not the whole of a long document: only what can count
                parts.append(data)
                size += len(data)
                if size >= limit:
                    return b"".join(parts)[:limit]
        return b"".join(parts)
    if not request.prompts:
        return b""
    first = request.prompts[0]
    if isinstance(first, str):
        return _head(first, limit)
    ids = first[: limit // 8]
    try:
        return array("q", ids).tobytes()
    except OverflowError:  # an id past 2**63 - 1: the engine will refuse it; any stable key does here
        return repr(ids).encode()[:limit]


def _head(text: str, limit: int) -> bytes:
    """The first ``limit`` bytes of ``text`` in UTF-8, encoding no more than ``limit`` characters of it (each is
    at least one byte)."""
    return text[:limit].encode("utf-8", "surrogatepass")[:limit]


def _message_texts(message: dict[str, object]) -> list[str]:
    texts = [f"\x00{message.get('role', '')}\x00"]
    content = message.get("content")
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        texts += [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return texts
