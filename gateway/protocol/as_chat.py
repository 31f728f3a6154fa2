"""``/v1/responses`` and ``/v1/messages`` (Anthropic) bodies as the chat messages vLLM builds from them.

vLLM serves both routes by turning the body into a chat request and rendering it with the model's chat template,
so kvgate counts the same messages: vLLM 0.32's ``construct_input_messages`` (Responses) and
``AnthropicServingMessages.to_chat_completion_request`` (Anthropic), followed closely. What matters most is
what is *not* text: an image stays an image part (counted as the template and the engine count images; its
base64 data read as text was tens of thousands of tokens per image, refused as longer than the context), and
tool calls become the ``tool_calls`` a template renders, not their JSON.

Malformed items are the client's error (400), as vLLM's validation answers; what vLLM passes through
unexamined (a message with a role) is passed through here too.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.protocol.errors import bad_request
from gateway.protocol.requests import check_content_parts, template_tool

Message = dict[str, Any]

NAMESPACE_SEPARATOR = "__"  # a namespace's function is shown to the model as <namespace>__<name>
# the function a Responses custom tool is shown as: one free-form string
_SHIM = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The freeform text payload for this tool."}},
    "required": ["input"],
    "additionalProperties": False,
}
# Claude Code's attribution line: vLLM drops it from system text (its per-request hash defeats prefix caching).
_BILLING_HEADER = "x-anthropic-billing-header"


def responses_messages(body: dict[str, Any]) -> list[Message]:
    """``instructions`` and ``input`` as vLLM's ``construct_input_messages`` turns them into chat messages,
    after the history a client sends in ``previous_input_messages`` (vLLM's extension, which a harmony model
    such as gpt-oss renders before the input: a prompt like any other). A ``previous_response_id``'s stored
    history, which only the engine has, is not counted."""
    messages: list[Message] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string.", param="instructions")
    previous = body.get("previous_input_messages")
    if previous is not None and not isinstance(previous, list):
        raise bad_request("'previous_input_messages' must be an array.", param="previous_input_messages")
    history = [_previous_text(item, f"previous_input_messages[{i}]") for i, item in enumerate(previous or [])]
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise bad_request(f"input[{i}] must be an object.", param=f"input[{i}]")
            message = _from_item(item, messages[-1] if messages else None, f"input[{i}]")
            if message is not None:
                messages.append(message)
    elif items is not None:
        raise bad_request("'input' must be a string or an array of items.", param="input")
    if any(history):
        _fold_history(messages, "\n\n".join(history))
    return messages


def _fold_history(messages: list[Message], history: str) -> None:
    """The text of ``previous_input_messages`` at the head of the first user turn: priced, in no turn of its
    own (a template that rejects a system turn, or turns out of alternation, would refuse a request vLLM
    serves: only a harmony model renders the field); a system turn only when there is no user turn."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if message.get("role") != "user":
            continue
        if isinstance(content, str) or content is None:
            messages[i] = {**message, "content": history + "\n\n" + (content or "")}
            return
        if isinstance(content, list):
            messages[i] = {**message, "content": [{"type": "text", "text": history}, *content]}
            return
    messages.insert(
        1 if messages and messages[0].get("role") == "system" else 0, {"role": "system", "content": history}
    )


def responses_tools(body: dict[str, Any]) -> list[Any] | None:
    """The tools the template is shown, as vLLM's ``get_function_tools`` and ``construct_tool_dicts`` give
    them: a function tool in a chat tool's ``function``, a namespace's functions as ``<namespace>__<name>``, a
    custom tool as a function of one string; built-in tools (web search, ...) are not rendered."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise bad_request("'tools' must be an array of objects.", param="tools")
    functions: list[dict[str, Any]] = []
    for tool in tools:
        if tool.get("type") == "function":
            functions.append({k: v for k, v in tool.items() if k != "type"})
        elif tool.get("type") == "custom":
            functions.append({"name": tool.get("name"), "description": tool.get("description"), "parameters": _SHIM})
        elif tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            prefix = f"{tool.get('name')}{NAMESPACE_SEPARATOR}"
            for inner in tool["tools"]:
                if isinstance(inner, dict) and inner.get("type") == "function":
                    name = prefix + str(inner.get("name"))
                    functions.append({k: v for k, v in inner.items() if k != "type"} | {"name": name})
    return [template_tool({"type": "function", "function": function}) for function in functions] or None


def _from_item(item: dict[str, Any], previous: Message | None, where: str) -> Message | None:
    """One input item as a new message, or None when it was folded into ``previous`` (an assistant turn
    spans its reasoning, its text and its tool calls)."""
    assistant = previous if previous is not None and previous.get("role") == "assistant" else None
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        if kind == "function_call":
            arguments = item.get("arguments")
            arguments = arguments if isinstance(arguments, str) else ""
        else:  # a custom tool is shown as a function of one string, its input (vLLM's shim)
            arguments = json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
        name = item.get("name")
        if item.get("namespace"):
            name = f"{item['namespace']}{NAMESPACE_SEPARATOR}{name}"
        call = {"id": item.get("call_id"), "type": "function", "function": {"name": name, "arguments": arguments}}
        if assistant is not None and isinstance(assistant.setdefault("tool_calls", []), list):
            assistant["tool_calls"].append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        reasoning = _first_text(parts)
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output")
        if isinstance(output, list):
            check_content_parts(output, f"{where}.output")
        elif output is not None and not isinstance(output, str):
            raise bad_request(f"{where}.output must be a string or an array of parts.", param=f"{where}.output")
        return {"role": "tool", "content": output, "tool_call_id": item.get("call_id")}
    role = item.get("role")
    if role == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else _first_text(content)
        if assistant is not None and assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    if isinstance(role, str):
        content = item.get("content")
        if isinstance(content, list):
            check_content_parts(content, f"{where}.content")
        elif content is not None and not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string or an array of parts.", param=f"{where}.content")
        return item  # parts as sent: text parts are text, images are images (vLLM's chat parsing reads both)
    raise bad_request(f"Unsupported input item type: {kind}", param="input")


def _previous_text(item: Any, where: str) -> str:
    """One message of ``previous_input_messages``, in chat (``role``) or harmony (``author.role``) form, as its
    role and whole text (every text part; any other content as its JSON): priced, never less than it is."""
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object.", param=where)
    author = item.get("author")
    role = author.get("role") if isinstance(author, dict) else item.get("role")
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(
            p["text"] if isinstance(p, dict) and isinstance(p.get("text"), str) else json.dumps(p, ensure_ascii=False)
            for p in content
        )
    else:
        text = "" if content is None else json.dumps(content, ensure_ascii=False)
    return f"{role if isinstance(role, str) else 'user'}: {text}"


def _first_text(parts: Any) -> str:
    """The text of an item's first part, as vLLM takes an assistant turn's or a reasoning item's."""
    if isinstance(parts, list) and parts and isinstance(parts[0], dict) and isinstance(parts[0].get("text"), str):
        text: str = parts[0]["text"]
        return text
    return ""


def anthropic_messages(body: dict[str, Any]) -> list[Message]:
    """``system`` and ``messages`` as vLLM's Anthropic front end converts them."""
    messages: list[Message] = []
    system = body.get("system")
    if system:
        # a string as sent (the template's parser drops a billing-header line); blocks without header blocks
        text = system if isinstance(system, str) else _system_text(system, "system")
        if text:
            messages.append({"role": "system", "content": text})
    listed = body.get("messages")
    if not isinstance(listed, list) or not listed:
        raise bad_request("'messages' must be a non-empty array.", param="messages")
    for i, message in enumerate(listed):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"{where} must be an object with a string 'role'.", param=where)
        role, content = message["role"], message.get("content")
        if role == "system":
            text = _system_text(content, f"{where}.content")
            if text:
                messages.append({"role": "system", "content": text})
            continue
        converted: Message = {"role": role}
        if isinstance(content, str):
            converted["content"] = content
        elif isinstance(content, list):
            _convert_blocks(content, converted, messages, f"{where}.content")
        elif content is not None:
            raise bad_request(f"{where}.content must be a string or an array of blocks.", param=f"{where}.content")
        if not (role == "user" and "content" not in converted):
            messages.append(converted)
    return messages


def anthropic_tools(body: dict[str, Any]) -> list[Any] | None:
    """Anthropic tools as the chat template sees them: functions whose parameters are the input schema."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise bad_request("'tools' must be an array of objects.", param="tools")
    return [
        template_tool(
            {
                "type": "function",
                "function": {
                    "name": tool.get("name"),
                    "description": tool.get("description"),
                    "parameters": _object_schema(tool.get("input_schema")),
                    "strict": tool.get("strict"),
                    "defer_loading": tool.get("defer_loading"),
                },
            }
        )
        for tool in tools
    ]


def _object_schema(schema: Any) -> Any:
    """An input schema as vLLM's AnthropicTool validates it: ``"type": "object"`` added (last) when absent."""
    return {**schema, "type": "object"} if isinstance(schema, dict) and "type" not in schema else schema


def _system_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return "" if content.startswith(_BILLING_HEADER) else content
    texts = []
    for block in _blocks(content, where):
        text = block.get("text")
        if block.get("type") == "text" and isinstance(text, str) and not text.startswith(_BILLING_HEADER):
            texts.append(text)
    return "".join(texts)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of blocks.", param=where)
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise bad_request(f"{where}[{j}] must be an object (a content block).", param=f"{where}[{j}]")
    return content


def _convert_blocks(content: list[Any], converted: Message, messages: list[Message], where: str) -> None:
    """A message's blocks: text and images become content parts, thinking the reasoning, ``tool_use`` the
    tool calls; a user's ``tool_result`` becomes a tool message (and its images a user message) before it."""
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in _blocks(content, where):
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})  # as vLLM writes them (json, not orjson: spacing)
            function = {"name": block.get("name"), "arguments": arguments}
            tool_calls.append({"id": block.get("id"), "type": "function", "function": function})
        elif kind == "tool_result":
            if converted["role"] == "user":
                messages.extend(_tool_result(block))
            else:
                result = block.get("content")
                parts.append({"type": "text", "text": f"Tool result: {result if result else ''}"})
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if tool_calls:
        converted["tool_calls"] = tool_calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        converted["content"] = parts[0]["text"]
    elif parts:
        converted["content"] = parts


def _tool_result(block: dict[str, Any]) -> list[Message]:
    content = block.get("content")
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for item in content:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "text":
                texts.append(str(item.get("text", "")))
            elif item.get("type") == "image" and isinstance(item.get("source"), dict):
                images.append({"type": "image_url", "image_url": {"url": _image_url(item["source"])}})
    out: list[Message] = [{"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": "\n".join(texts)}]
    if images:
        out.append({"role": "user", "content": images})
    return out


def _image_url(source: Any) -> str:
    """An image source as the URL vLLM's media connector loads: as given, or a data URI of its base64."""
    if not isinstance(source, dict):
        raise bad_request("An image block's 'source' must be an object.", param="source")
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"
