"""Parsing: turn a request body into the few fields admission needs, or a 400 that says what is wrong.

The body itself is forwarded unchanged, but for two members appended to it: a stream's request for its usage
(:mod:`gateway.protocol.stream_usage`) and a tenant's cache salt (:mod:`gateway.protocol.cache_salt`). Checks
stop at what the gateway relies on (prompt, messages, n, max_tokens, stream) and what it tokenizes
(message content parts, names, tool calls, tools): anything the tokenizer or a chat template would trip over
must be a 400 here, never a 500 later. Everything else is the engine's business, except fields the engine
acts on that are the gateway's to decide or that it cannot price (:data:`ENGINE_CONTROLS`, refused by
:func:`refuse_engine_controls`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway.protocol.errors import bad_request

Endpoint = Literal["chat", "completions"]
Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    endpoint: Endpoint
    model: str | None
    sequences_per_prompt: int
    max_tokens: int | None
    messages: list[dict[str, Any]] | None
    prompts: list[Prompt]
    tools: list[Any] | None
    min_tokens: int = 0  # vLLM's floor: the output is at least this long (if the budget allows)
    # vLLM's truncate_prompt_tokens: the engine keeps at most this many prompt tokens (-1: as many as the
    # context allows); None: no truncation
    truncate_to: int | None = None
    # vLLM's stream_interval: a stream's events after the first carry this many tokens each (the last fewer)
    stream_interval: int = 1
    # a stream whose client asked for no usage (stream_options.include_usage): kvgate asks for it itself and
    # drops it from the client's stream (gateway.protocol.stream_usage)
    usage_hidden: bool = False
    stream_options_given: bool = False  # the body has stream_options (asking for the usage merges into them)
    # answered in one piece, not streamed: a client's read timeout must cover the whole generation
    whole_answer: bool = False
    # what vLLM hands a chat template beyond the messages and tools: the client's chat_template_kwargs and its
    # documents (RAG templates render them); part of the prompt, so counted with it
    template_kwargs: dict[str, Any] | None = None
    # the engine puts a history kvgate never sees before this prompt (a Responses previous_response_id, from its
    # own store): priced without it, and its usage says nothing of this prompt's size
    history_elsewhere: bool = False
    # the tokenizer's special tokens (BOS) added to the prompt as well: None is the route's default in vLLM (yes for
    # completions, no for a chat, whose template has them); the Responses API always adds them, to the rendered
    # chat too (ResponsesRequest leaves add_special_tokens at its default)
    add_special_tokens: bool | None = None


# vLLM's CompletionRequest defaults max_tokens to 16; chat leaves it open (the context's rest).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# A floor no budget reaches: the request runs to its budget (ignore_eos, or audio nobody can predict), so no
# estimate of where it stops applies.
RUNS_TO_BUDGET = 2**31 - 1


def json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says why not."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


@dataclass(frozen=True, slots=True)
class EngineControl:
    """A body field the engine acts on that a client may not set: ``allowed`` is the one value a client may
    still send (the engine's default; None: only null or absent), ``message`` the 400 it gets otherwise."""

    allowed: object
    message: str


# Refused when present and not null (unless ``allowed``); a dotted name is a key inside an object field.
ENGINE_CONTROLS: dict[str, EngineControl] = {
    # vLLM's priority scheduling orders its queue and preempts by it: kvgate sets it from the tenant's class
    "priority": EngineControl(
        0, "'priority' is set by the gateway from your tenant's priority class: leave it out (or 0)."
    ),
    # KV connectors pin blocks and move KV between engines from it: memory kvgate's ledger cannot see
    "kv_transfer_params": EngineControl(
        None, "'kv_transfer_params' steers the engine's KV cache transfers, which only the operator may do."
    ),
    # EC connectors move encoder caches between engines from it, likewise outside kvgate's ledger
    "ec_transfer_params": EngineControl(
        None, "'ec_transfer_params' steers the engine's encoder cache transfers, which only the operator may do."
    ),
    # --enable-prompt-embeds runs them as prompt tokens kvgate cannot count (that takes torch)
    "prompt_embeds": EngineControl(
        None, "'prompt_embeds' is not accepted through this gateway: send the prompt as text or token ids."
    ),
    # vLLM copies vllm_xargs into the request's extra_args, where the connectors read the same two fields
    "vllm_xargs.kv_transfer_params": EngineControl(
        None, "'vllm_xargs.kv_transfer_params' steers the engine's KV cache transfers: leave it out."
    ),
    # the same for the EC connectors
    "vllm_xargs.ec_transfer_params": EngineControl(
        None, "'vllm_xargs.ec_transfer_params' steers the engine's encoder cache transfers: leave it out."
    ),
}


_CONTROL_PATHS = tuple((name, tuple(name.split(".")), control) for name, control in ENGINE_CONTROLS.items())
_CONTROL_KEYS = frozenset(path[0] for _, path, _ in _CONTROL_PATHS)  # their top-level keys


def refuse_engine_controls(body: dict[str, Any]) -> None:
    """A 400 (``param``: the field) for the first of :data:`ENGINE_CONTROLS` the body sets: kvgate is the only
    door to the engine, so what the engine acts on is either priced by kvgate or the gateway's to say. Every
    JSON body passes here: one set test when it names none of them."""
    if _CONTROL_KEYS.isdisjoint(body):
        return
    for name, path, control in _CONTROL_PATHS:
        value = _nested(body, path)
        if value is not None and (control.allowed is None or value != control.allowed):
            raise bad_request(control.message, param=name)


def _nested(body: dict[str, Any], path: tuple[str, ...]) -> Any:
    """``body["a"]["b"]`` for ``("a", "b")``; None where a level is missing or not an object."""
    value: Any = body
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


# Variables kvgate sets itself when it renders a chat template to count it (as vLLM does), which a client's
# chat_template_kwargs do not override in the count (vLLM refuses chat_template and tokenize outright).
TEMPLATE_OWN_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize"}
)


def chat_template_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    """What vLLM passes a chat's template beside its messages and tools: the client's ``chat_template_kwargs``
    with its ``documents`` (a list of objects, RAG templates render them) over them; None when neither is sent."""
    kwargs = optional_field(body, "chat_template_kwargs", dict)
    documents = optional_field(body, "documents", list)
    if documents is not None:
        _objects(documents, "documents")
    if not kwargs and documents is None:
        return None
    merged = {k: v for k, v in (kwargs or {}).items() if k not in TEMPLATE_OWN_VARIABLES}
    if documents is not None:
        merged["documents"] = documents
    return merged


def parse_request(endpoint: Endpoint, raw: bytes) -> InferenceRequest:
    body = json_object(raw)
    refuse_engine_controls(body)
    model = optional_field(body, "model", str)
    stream = optional_field(body, "stream", bool)
    stream_options = optional_field(body, "stream_options", dict) or {}
    for key in ("include_usage", "continuous_usage_stats"):
        optional_field(stream_options, key, bool, f"stream_options.{key}")
    n = _positive_int(body, "n") or 1
    # best_of is not read: vLLM's V1 engine has none (0.32's chat and completions requests drop it), so it
    # neither multiplies the sequences nor may it be refused
    if endpoint == "completions" and body.get("echo") is True and body.get("max_tokens") == 0:
        max_tokens: int | None = 1  # vLLM runs an echo without generation as one token
    else:
        max_tokens = _positive_int(body, "max_tokens")
    if endpoint == "chat":
        max_tokens = _positive_int(body, "max_completion_tokens") or max_tokens
    elif max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    min_tokens = optional_field(body, "min_tokens", int) or 0
    if min_tokens < 0:
        raise bad_request(f"'min_tokens' must be at least 0, got {min_tokens}.", param="min_tokens")
    if optional_field(body, "ignore_eos", bool):
        min_tokens = RUNS_TO_BUDGET

    truncate_to = truncation(body)
    stream_interval = _positive_int(body, "stream_interval") or 1
    messages: list[dict[str, Any]] | None = None
    prompts: list[Prompt] = []
    tools = optional_field(body, "tools", list)
    template_kwargs: dict[str, Any] | None = None
    if endpoint == "chat":
        messages = _messages(body)
        if tools is not None:
            _objects(tools, "tools")  # rendered by the chat template, or dumped to JSON and counted
            tools = [template_tool(tool) for tool in tools]
        template_kwargs = chat_template_kwargs(body)
    else:
        prompts = _prompts(body)
    special = lax_bool(body.get("add_special_tokens"))
    return InferenceRequest(
        add_special_tokens=special,
        endpoint=endpoint,
        model=model,
        sequences_per_prompt=n,
        max_tokens=max_tokens,
        messages=messages,
        prompts=prompts,
        tools=tools,
        min_tokens=min_tokens,
        truncate_to=truncate_to,
        stream_interval=stream_interval,
        usage_hidden=stream is True and stream_options.get("include_usage") is not True,
        whole_answer=stream is not True,
        template_kwargs=template_kwargs,
        stream_options_given="stream_options" in body,
    )


def truncation(body: dict[str, Any]) -> int | None:
    """``truncate_prompt_tokens``: an int of at least -1, or absent."""
    value = optional_field(body, "truncate_prompt_tokens", int)
    if value is not None and value < -1:
        raise bad_request(f"'truncate_prompt_tokens' must be at least -1, got {value}.", param="truncate_prompt_tokens")
    return value  # type: ignore[no-any-return]


def optional_field(body: dict[str, Any], key: str, kind: type, param: str | None = None) -> Any:
    """``body[key]`` if present, which must then be of ``kind`` (a bool is not an int here); else None."""
    value = body.get(key)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise bad_request(f"'{param or key}' must be of type {kind.__name__}.", param=param or key)
    return value


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = optional_field(body, key, int)
    if value is not None and value < 1:
        raise bad_request(f"'{key}' must be at least 1, got {value}.", param=key)
    return value  # type: ignore[no-any-return]


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array.", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'.", param=f"messages[{i}]")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise bad_request(f"messages[{i}].content must be a string or an array.", param=f"messages[{i}]")
        if isinstance(content, list):
            check_content_parts(content, f"messages[{i}].content")
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise bad_request(f"messages[{i}].name must be a string.", param=f"messages[{i}].name")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            _objects(tool_calls, f"messages[{i}].tool_calls")
    return messages


# Part types whose text is in "text" (vLLM's TEXT_PART_TYPES less refusal and thinking, which use other keys).
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def check_content_parts(parts: list[Any], where: str) -> None:
    """Each part is an object with a string ``type`` (a text part with a string ``text``), or a bare string,
    which vLLM accepts as a text part. Other part types (images, audio) are the engine's to check."""
    for j, part in enumerate(parts):
        if isinstance(part, str):
            continue
        if not isinstance(part, dict):
            raise bad_request(
                f"{where}[{j}] must be an object (a content part), got {_json_type(part)}.", param=f"{where}[{j}]"
            )
        kind = part.get("type")
        if kind is not None and not isinstance(kind, str):
            raise bad_request(f"{where}[{j}].type must be a string.", param=f"{where}[{j}].type")
        if kind in _TEXT_PARTS and not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}[{j}].text must be a string, got {_json_type(part.get('text'))}.", param=f"{where}[{j}].text"
            )


_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})


def lax_bool(value: Any) -> bool | None:
    """A boolean as vLLM's pydantic models read one (``1``, ``"true"``, ``"off"``...); None for anything else
    (absent, or a value the engine itself refuses)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        return True if word in _TRUE else False if word in _FALSE else None
    return None


def template_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as vLLM hands it to the chat template (``ChatCompletionToolsParam.model_dump()``): the
    function's name, description and parameters always (null when not given: a template that prints the tool as
    JSON prints them), strict and defer_loading when set, in that order, and nothing else; other kinds of tool
    as sent (the engine refuses them)."""
    function = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(function, dict):
        return tool
    shown: dict[str, Any] = {
        "name": function.get("name"),
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    defer = lax_bool(function.get("defer_loading"))
    if defer is None:
        defer = lax_bool(tool.get("defer_loading"))  # vLLM hands the tool's own down to its function
    if (strict := lax_bool(function.get("strict"))) is not None:
        shown["strict"] = strict
    if defer is not None:
        shown["defer_loading"] = defer
    dumped: dict[str, Any] = {"type": "function", "function": shown}
    if (own := lax_bool(tool.get("defer_loading"))) is not None:
        dumped["defer_loading"] = own
    return dumped


def _objects(value: Any, where: str) -> None:
    """An array of objects (tool calls, tools): what chat templates iterate and index into."""
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be an array.", param=where)
    for j, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad_request(f"{where}[{j}] must be an object, got {_json_type(item)}.", param=f"{where}[{j}]")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _prompts(body: dict[str, Any]) -> list[Prompt]:
    """A completions prompt: a string, token ids, or a batch of either (each one is its own request).

    Like vLLM: an empty string is a 400 (``prompt_embeds``, which vLLM would take instead, is refused before),
    and token ids are never negative. An empty prompt inside a batch is a 400 too (vLLM refuses an empty token
    list with "The decoder prompt cannot be empty")."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if _all_ints(prompt):
            _token_ids(prompt, "prompt")
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            for j, p in enumerate(prompt):
                if not p:
                    raise bad_request(f"prompt[{j}] is empty; every prompt of a batch needs text.", param="prompt")
            return list(prompt)
        if all(isinstance(p, list) and _all_ints(p) for p in prompt):
            for j, p in enumerate(prompt):
                if not p:
                    raise bad_request(f"prompt[{j}] is empty; every prompt of a batch needs tokens.", param="prompt")
                _token_ids(p, f"prompt[{j}]")
            return list(prompt)
    raise bad_request(
        "'prompt' must be a string, an array of strings, an array of token ids, or an array of those.",
        param="prompt",
    )


def _all_ints(values: list[Any]) -> bool:
    """Every item is an int, never a bool (``type(True)`` is ``bool``). Counted in C: a 3,000-token prompt is
    checked in ~40 us where a generator over ``isinstance`` took ~230 us, most of a burst's arrival cost."""
    return list(map(type, values)).count(int) == len(values)


def _token_ids(ids: list[int], where: str) -> None:
    """Negative ids are out of every vocabulary (vLLM: "Token id -1 is out of vocabulary"). The upper bound
    depends on the model: :class:`gateway.tokens.counting.TokenCounter` checks it when the tokenizer is known."""
    lowest = min(ids)
    if lowest < 0:
        raise bad_request(f"Token id {lowest} in {where} is out of vocabulary.", param="prompt")
