"""The messages a chat template sees, as vLLM 0.32 hands them over (``renderers/chat_utils.py``,
``renderers/hf.py``), so that kvgate renders, and counts, the prompt the engine builds.

vLLM does not give the template the request's messages as sent:

* content becomes a list of parts (``None`` is no parts, a string one text part), then, by the template's
  *content format*: ``string`` joins the text parts with newlines (a media item's placeholder, which the
  model's processor defines, is left out: a few tokens per item that its learned allowance,
  :mod:`gateway.tokens.media`, takes in); ``openai`` keeps them as ``{"type": "text", "text"}`` and
  ``{"type": "image"}`` (audio, video) dicts. The format is read off the template: does it loop over a
  message's content?
* an assistant's tool call ``arguments`` (a JSON string in the API) becomes an object (``{}`` when it is empty
  or not a JSON object), and an empty ``tool_calls`` list is dropped;
* a tool message's text parts are joined into one string;
* a system message loses Claude Code's billing-header line;
* ``developer`` messages become ``system`` ones, merged into one at the start, when the template does not
  mention that role.

Without this, an assistant turn with tool calls and no content (what the OpenAI SDK sends back) made a
template that loops over content fail, a 400 for a request vLLM serves. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]

# part type -> the key its text is under
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_MEDIA_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
}
# The keys of the content part types vLLM knows: what is not one of them is passed on to the template as is.
_KNOWN_PART_FIELDS = frozenset(
    {"type", "text", "refusal", "thinking", "image_url", "input_audio", "audio_url", "video_url", "image_pil"}
    | {"image_embeds", "audio_embeds", "video_embeds", "uuid", "detail", "file", "file_id", "name", "data"}
)
# a part without a type is read by the first of these keys it has (vLLM's order)
_UNTYPED_MEDIA = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "audio_url",
    "input_audio",
    "video_url",
)
_BILLING_HEADER = "x-anthropic-billing-header"


def conversation(
    messages: Sequence[Mapping[str, Any]], content_format: ContentFormat, template_source: str = ""
) -> list[dict[str, Any]]:
    """``messages`` as vLLM passes them to the chat template."""
    out = [_message(m, content_format) for m in messages]
    for message in out:
        _tool_call_arguments(message)
    if any(m["role"] == "developer" for m in out) and not _mentions_developer(template_source):
        out = _developer_as_system(out)
    return out


def media_items(messages: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """How many images, audio clips and videos the messages carry, by modality (each item is expanded by the
    model's processor)."""
    counts: dict[str, int] = {}
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                modality = _modality(part)
                if modality is not None:
                    counts[modality] = counts.get(modality, 0) + 1
    return counts


def _modality(part: Any) -> str | None:
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind is None:
        kind = next((key for key in _UNTYPED_MEDIA if key in part), None)
    return _MEDIA_PARTS.get(kind) if isinstance(kind, str) else None


def _message(message: Mapping[str, Any], content_format: ContentFormat) -> dict[str, Any]:
    role = message.get("role")
    content = message.get("content")
    parts: list[Any] = [] if content is None else [content] if isinstance(content, str) else list(content)
    if role == "system":
        parts = _without_billing_header(parts)
    converted: dict[str, Any] = {"role": role, "content": _content(parts, content_format)}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            converted["tool_calls"] = [dict(call) for call in message["tool_calls"]]
        if message.get("reasoning") is not None:
            converted["reasoning"] = converted["reasoning_content"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            converted["tool_call_id"] = message["tool_call_id"]
        body = converted["content"]
        if isinstance(body, list) and not any(isinstance(p, dict) and p.get("type") != "text" for p in body):
            converted["content"] = "\n".join(p.get("text", "") for p in body if isinstance(p, dict))
    if isinstance(message.get("name"), str):
        converted["name"] = message["name"]
    if isinstance(message.get("task"), str):
        converted["task"] = message["task"]
    if role == "developer":
        converted["tools"] = message.get("tools")
    return converted


def _content(parts: list[Any], content_format: ContentFormat) -> str | list[dict[str, Any]]:
    wrapped: list[dict[str, Any]] = []
    texts: list[str] = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
            wrapped.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind is None:  # no type, but a media field: vLLM reads the part by it
            kind = next((key for key in _UNTYPED_MEDIA if key in part), None)
        if not isinstance(kind, str):
            continue  # vLLM refuses it (400); it renders as nothing here
        if kind in _TEXT_PARTS:
            text = part.get(_TEXT_PARTS[kind])
            if text is None:
                continue  # vLLM skips a text part without text
            texts.append(text)
            wrapped.append({"type": "text", "text": text, **_extra_fields(part)})
        elif kind in _MEDIA_PARTS:
            wrapped.append({"type": _MEDIA_PARTS[kind], **_extra_fields(part)})
        elif kind == "tool_reference":
            texts.append(str(part.get("name", "")))
            wrapped.append({"type": "tool_reference", "name": part.get("name")})
    return wrapped if content_format == "openai" else "\n".join(texts)


def _extra_fields(part: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}


def _without_billing_header(parts: list[Any]) -> list[Any]:
    kept: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) else None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            kept.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            kept.append(rest if isinstance(part, str) else {**part, "text": rest})
    return kept


def _tool_call_arguments(message: dict[str, Any]) -> None:
    """Tool-use templates expect ``arguments`` as an object, so vLLM parses the API's JSON string."""
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not isinstance(calls, list):
        return
    if not calls:
        del message["tool_calls"]
        return
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue  # vLLM refuses it (400); the template will too, or count it as it renders
        function = calls[i]["function"] = dict(function)
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        function["arguments"] = arguments if isinstance(arguments, dict) else {}


def _has_text(part: Any) -> bool:
    return isinstance(part, str) or (isinstance(part, dict) and "text" in part)


def _mentions_developer(template_source: str) -> bool:
    return '"developer"' in template_source or "'developer'" in template_source


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer turns as system ones, all system turns merged into the first message when any is not first
    (some templates require it so)."""
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
        for m in messages
    ]
    systems: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, message in enumerate(converted):
        if message["role"] != "system":
            rest.append(message)
            continue
        merge = merge or i > 0 or bool(systems)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p if isinstance(p, str) else p["text"] for p in content if _has_text(p))
        if content:
            systems.append(content)
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest] if merge else converted


# --- the template's content format, read off its syntax tree (vLLM's _detect_content_format) ------------------


def content_format(template_source: str) -> ContentFormat:
    """``openai`` when the template loops over a message's content (or a macro's parameter given it), else
    ``string``; ``string`` too when the template does not parse (vLLM's default, ``auto``, falls back so)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    try:
        tree = env.parse(template_source)
        return "openai" if next(_content_loops(tree, jinja2.nodes), None) is not None else "string"
    except Exception:  # a template vLLM's parser also fails on: vLLM takes its default
        return "string"


def _is_var(node: Any, name: str, nodes: Any) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: Any, name: str, key: str, nodes: Any) -> bool:
    if isinstance(node, nodes.Getitem):
        return _is_var(node.node, name, nodes) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_var(node.node, name, nodes) and node.attr == key
    return False


def _is_var_or_elems(node: Any, name: str, key: str | None, nodes: Any) -> bool:
    if isinstance(node, nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key, nodes)
    if isinstance(node, nodes.Test):
        return _is_var_or_elems(node.node, name, key, nodes)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _is_var_or_elems(node.node, name, key, nodes)
    return _is_attr(node, name, key, nodes) if key else _is_var(node, name, nodes)


def _aliases(root: Any, name: str, nodes: Any) -> Iterator[str]:
    """``name`` and every variable assigned from it (or a slice or filter of it), transitively."""
    yield name
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(nodes.Assign):
            if _is_var_or_elems(assign.node, current, None, nodes) and isinstance(assign.target, nodes.Name):
                yield assign.target.name
                if assign.target.name != current:
                    pending.append(assign.target.name)


def _message_vars(root: Any, nodes: Any) -> list[str]:
    names = list(_aliases(root, "messages", nodes))
    found = []
    for loop in root.find_all(nodes.For):
        if any(_is_var_or_elems(loop.iter, n, None, nodes) for n in names) and isinstance(loop.target, nodes.Name):
            found.append(loop.target.name)
    return found


def _content_loops(root: Any, nodes: Any) -> Iterator[Any]:
    """The loops over a message's content: ``for part in message['content']``, over a macro parameter that
    a call gives ``message.content``, or over a variable named ``content`` outside macros."""
    message_vars = _message_vars(root, nodes)
    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        names = {arg.name for arg in macro.args}
        params: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_is_var_or_elems(arg, v, "content", nodes) for v in message_vars):
                    params.add(macro.args[i].name)
            for kwarg in call.kwargs:
                if kwarg.key in names and any(_is_var_or_elems(kwarg.value, v, "content", nodes) for v in message_vars):
                    params.add(kwarg.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in root.find_all(nodes.For):
        over_content = any(_is_var_or_elems(loop.iter, v, "content", nodes) for v in message_vars)
        over_param = isinstance(loop.iter, nodes.Name) and (
            loop.iter.name in params_by_loop.get(id(loop), ())
            or (id(loop) not in in_macros and loop.iter.name == "content")
        )
        if over_content or over_param:
            yield loop
