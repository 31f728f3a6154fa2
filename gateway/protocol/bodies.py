"""Reading a generation route's body for its cost: every route kvgate admits becomes an
:class:`~gateway.protocol.requests.InferenceRequest` (messages or prompts, and an output budget).

Chat and completions are read exactly (:mod:`gateway.protocol.requests`). The other routes are costed as the
engine sees them, coarsely where the body does not say more:

* ``/v1/responses``: ``instructions`` and ``input`` items become the chat messages vLLM makes of them
  (:mod:`gateway.protocol.as_chat`); ``max_output_tokens`` caps the output (absent: up to the context length,
  as chat).
* ``/v1/messages`` (Anthropic): ``system``, ``messages`` and ``tools`` become the chat request vLLM makes of
  them; ``max_tokens`` caps the output.
* ``/invocations`` (SageMaker): ``messages`` -> chat, ``prompt`` -> completions, ``input`` -> pooling. vLLM
  does not dispatch on keys: it runs the first request type whose validation passes, and every type allows
  extra fields, so a body with the fields of two types is refused (:data:`INVOCATION_TYPES`).
* pooling routes (embeddings, ``/pooling``, ``/classify``): the inputs are prompts that produce no output tokens.
* scoring routes (``/score``, ``/rerank``): each query/document pair is a prompt of its own, no output.
* audio (multipart): the body is not parsed; the request reserves the whole context length (the decoder's own
  limit), which is coarse but never short.

Every JSON body is refused with a field the engine acts on that a client may not set (a ``priority`` other than
0, KV/EC transfer parameters, prompt embeddings: :data:`gateway.protocol.requests.ENGINE_CONTROLS`); so is an
audio form that names ``vllm_xargs`` (where vLLM's audio requests take the transfer parameters), or is in a
charset where that name would be other bytes.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import orjson

from gateway.paths import BodyKind
from gateway.protocol.as_chat import anthropic_messages, anthropic_tools, responses_messages, responses_tools
from gateway.protocol.errors import bad_request
from gateway.protocol.requests import (
    RUNS_TO_BUDGET,
    InferenceRequest,
    Prompt,
    json_object,
    optional_field,
    parse_request,
    refuse_engine_controls,
    truncation,
)


def parse_body(kind: BodyKind, raw: bytes, content_type: bytes | None = None) -> InferenceRequest:
    """``content_type``: the request's, read for audio forms only (:func:`refuse_form_engine_controls`)."""
    if kind in ("chat", "completions"):
        return parse_request(kind, raw)
    if kind == "audio":
        refuse_form_engine_controls(raw, content_type)
        return InferenceRequest("completions", None, 1, None, None, [[]], None, min_tokens=RUNS_TO_BUDGET)
    body = json_object(raw)
    refuse_engine_controls(body)
    if kind == "invocations":
        refuse_ambiguous_invocation(body)
        if "messages" in body:
            return parse_request("chat", raw)
        if "prompt" in body:
            return parse_request("completions", raw)
        if "input" in body:
            return _pooling(body)
        raise bad_request("An /invocations body must carry 'messages', 'prompt' or 'input'.")
    if kind == "responses":
        return _responses(body)
    if kind == "messages":
        return _anthropic_messages(body)
    if kind == "pooling":
        return _pooling(body)
    return _score(body)


# Charsets in which a form's field names and values are the bytes they read as (starlette decodes the form
# with the request's charset: in UTF-7 or UTF-16 'vllm_xargs' is other bytes, so a search for it would miss it).
_PLAIN_CHARSETS = frozenset({"utf-8", "utf8", "us-ascii", "ascii", "iso-8859-1", "latin-1", "latin1"})
# RFC 2231's extended parameter (name*=UTF-8''vllm%5Fxargs): a name that is other bytes on the wire; RFC 7578
# has no use for it in a form, and a parser that decodes it would read a field the search above cannot see.
# The parameter exactly, whole (name*=) or in numbered pieces a parser joins (name*0=, name*1*=): not
# filename*= (which .NET's HttpClient sends with every file).
_EXTENDED_NAME = re.compile(rb"(?<![\w-])name\s*\*\s*(?:\d+\s*\*?\s*)?=", re.IGNORECASE)


def refuse_form_engine_controls(raw: bytes, content_type: bytes | None = None) -> None:
    """vLLM's audio requests take ``vllm_xargs`` as a form field holding JSON, and copy it into the request's
    extra args, where the KV and EC connectors read their transfer parameters. kvgate does not parse the form
    (the audio may be megabytes; a parser that is not vLLM's own would read it differently somewhere): an
    audio request that names ``vllm_xargs`` anywhere is refused, as is a form in a charset where that name
    would be other bytes, or one with a field named in RFC 2231's encoded form (``name*=``). Linear in the
    body."""
    if content_type is not None:
        for param in content_type.split(b";")[1:]:
            key, _, value = param.partition(b"=")
            charset = value.strip().strip(b'"').decode("latin-1").lower()
            if key.strip().lower() == b"charset" and charset not in _PLAIN_CHARSETS:
                raise bad_request(
                    f"An audio form in charset '{charset}' is not accepted through this gateway: send it in UTF-8.",
                    param="content-type",
                )
    if _EXTENDED_NAME.search(raw):
        raise bad_request(
            "A form field named in RFC 2231's encoded form (name*=, name*0=) is not accepted through this gateway: "
            'name it plainly (name="...").',
            param="content-disposition",
        )
    if b"vllm_xargs" in raw:
        raise bad_request(
            "'vllm_xargs' is not accepted on the audio routes through this gateway (it can steer the engine's KV "
            "cache transfers): leave it out.",
            param="vllm_xargs",
        )


# The fields that make each of vLLM's /invocations request types validate, in the order it tries them
# (serve/sagemaker/api_router.py): chat, completions, then the pooling model's embed/classify, rerank/score and
# pooling types (pooling's IO-processor plugin takes any ``data``).
INVOCATION_TYPES: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "completions": ("prompt", "prompt_embeds"),
    "pooling": ("input",),
    # not "documents": a chat carries them too (RAG chat templates), and a scoring body has its query beside them
    "scoring": ("query", "queries", "items", "data_1", "data_2", "text_1", "text_2"),
    "plugin": ("data",),
}


def refuse_ambiguous_invocation(body: dict[str, Any]) -> None:
    """A 400 for an /invocations body with the fields of more than one request type (even null ones): vLLM
    would run the first type that validates, maybe not the one kvgate priced (a small chat whose ``messages``
    fail chat validation runs as the completions batch in its ``prompt``)."""
    found = [[key for key in keys if key in body] for keys in INVOCATION_TYPES.values()]
    types = [keys for keys in found if keys]
    if len(types) > 1:
        fields = [key for keys in types for key in keys]
        named = ", ".join(f"'{key}'" for key in fields)
        raise bad_request(
            f"An /invocations body must carry the fields of one request type only (found: {named}).",
            param=", ".join(fields),
        )


def _model(body: dict[str, Any]) -> str | None:
    model: str | None = optional_field(body, "model", str)
    return model


def _budget(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise bad_request(f"'{key}' must be a positive integer.", param=key)
    return value


def _chat(
    body: dict[str, Any], messages: list[dict[str, Any]], max_tokens: int | None, tools: list[Any] | None
) -> InferenceRequest:
    if not messages:
        raise bad_request("The request has no input.", param="input")
    whole = optional_field(body, "stream", bool) is not True
    return InferenceRequest("chat", _model(body), 1, max_tokens, messages, [], tools, whole_answer=whole)


def _responses(body: dict[str, Any]) -> InferenceRequest:
    if body.get("background"):
        # the engine would go on generating after the answer, outside any reservation
        raise bad_request("Background responses are not supported through this gateway.", param="background")
    request = _chat(body, responses_messages(body), _budget(body, "max_output_tokens"), responses_tools(body))
    # vLLM encodes the rendered input with the tokenizer's special tokens again (a second BOS, for Llama's)
    request = replace(request, add_special_tokens=True, history_elsewhere=body.get("previous_response_id") is not None)
    # vLLM truncates to the context unless truncation is "disabled" (the default; a null is not)
    return replace(request, truncate_to=-1) if "truncation" in body and body["truncation"] != "disabled" else request


def _anthropic_messages(body: dict[str, Any]) -> InferenceRequest:
    return _chat(body, anthropic_messages(body), _budget(body, "max_tokens"), anthropic_tools(body))


def _prompts(value: Any, param: str) -> list[Prompt]:
    """A string, token ids, or a non-empty array of either; no empty prompt."""
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            return [value]
        if all(isinstance(p, str) and p for p in value):
            return list(value)
        if all(isinstance(p, list) and p and all(isinstance(t, int) and t >= 0 for t in p) for p in value):
            return list(value)
    raise bad_request(f"'{param}' must be a non-empty string, token ids, or a non-empty array of those.", param=param)


def _pooling(body: dict[str, Any]) -> InferenceRequest:
    """Embeddings, pooling, classification: prompts in, vectors or labels out, no output tokens. A body with
    both ``input`` and ``messages`` is a 400: vLLM's union of request types runs it as the chat (the messages),
    whatever ``input`` says, so pricing either one would be a guess at the other."""
    if "messages" in body:
        if "input" in body:
            raise bad_request("A pooling request carries 'input' or 'messages', not both.", param="input, messages")
        chat = parse_request("chat", orjson.dumps(body))
        return replace(chat, sequences_per_prompt=1, max_tokens=0, min_tokens=0, usage_hidden=False)  # no stream
    prompts = _prompts(body.get("input"), "input")
    return InferenceRequest(
        "completions", _model(body), 1, 0, None, prompts, None, truncate_to=truncation(body), whole_answer=True
    )


# The pairs a score or rerank body may carry (vLLM 0.32's ScoreRequest union and RerankRequest).
SCORE_PAIRS = (
    frozenset({"query", "documents"}),
    frozenset({"queries", "documents"}),
    frozenset({"queries", "items"}),
    frozenset({"text_1", "text_2"}),
    frozenset({"data_1", "data_2"}),
)
_SCORE_KEYS = frozenset().union(*SCORE_PAIRS)


def _score(body: dict[str, Any]) -> InferenceRequest:
    """Scoring and reranking: one prompt per query/document pair (a cross-encoder reads them together). A body
    with the fields of two pairs is a 400: vLLM's union of request types runs one of them (``text_1`` and
    ``text_2`` beside ``queries`` and ``documents``: the latter), not necessarily the one priced."""
    present = _SCORE_KEYS.intersection(body)
    if len(present) > 2 or (len(present) == 2 and present not in SCORE_PAIRS):
        fields = ", ".join(sorted(present))
        raise bad_request(f"A score request carries one pair of inputs (found: {fields}).", param=fields)
    first = next((body[k] for k in ("query", "text_1", "data_1", "queries") if k in body), None)
    second = next((body[k] for k in ("documents", "text_2", "data_2", "items") if k in body), None)
    firsts, seconds = _as_texts(first, "query"), _as_texts(second, "documents")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(seconds) == 1:
        seconds = seconds * len(firsts)
    if len(firsts) != len(seconds):
        raise bad_request("The two sides of a score request must pair up (one to many, or as many each).")
    prompts: list[Prompt] = [a + "\n" + b for a, b in zip(firsts, seconds, strict=True)]
    return InferenceRequest(
        "completions", _model(body), 1, 0, None, prompts, None, truncate_to=truncation(body), whole_answer=True
    )


def _as_texts(value: Any, param: str) -> list[str]:
    if isinstance(value, str | dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request(f"'{param}' must be a string or a non-empty array.", param=param)
    texts = []
    for item in value:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, dict):  # {"text": ...} documents, or multimodal content: counted as their JSON
            text = item.get("text")
            texts.append(text if isinstance(text, str) else orjson.dumps(item).decode())
        else:
            raise bad_request(f"'{param}' must hold strings or objects.", param=param)
    return texts
