"""OpenAI request validation and response shapes, as vLLM's OpenAI server produces them.

Pure functions: they turn a parsed JSON body into a :class:`Plan` or an :class:`ApiError`, and render chunks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

# Output text: a fixed cycle of words; the simulator's tokens carry no meaning, only their count matters.
_WORDS = (" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", ".")

BUSY_MESSAGE = (
    "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."
)
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
# Simulator-only body field: the request's natural output length (the token that is EOS). vLLM ignores unknown
# fields, so a load generator can send it to any backend; only the simulator acts on it.
SIM_OUTPUT_FIELD = "sim_output_tokens"


PROMPT_FORMS = "prompt must be a string, a list of token ids, or a list of those"
# vLLM's CompletionRequest default when a completion sends no max_tokens
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class ApiError(Exception):
    """An error with vLLM's body ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def body(self) -> bytes:
        return orjson.dumps(self.payload())


def busy_error() -> ApiError:
    return ApiError(503, BUSY_MESSAGE, "Service Unavailable")


def engine_dead_error() -> ApiError:
    return ApiError(500, ENGINE_DEAD_MESSAGE, "InternalServerError")


@dataclass(frozen=True)
class Plan:
    """A validated generation request."""

    kind: str  # "completion" or "chat"
    prompt_lens: tuple[int, ...]  # one per prompt: a completions batch has several, each its own engine request
    max_tokens: tuple[int, ...]  # each prompt's output budget, clamped to what its context leaves
    stream: bool
    include_usage: bool
    model: str
    output_tokens: int | None = None  # the body's natural length; None: the server's distribution decides
    min_tokens: int = 0
    ignore_eos: bool = False
    stream_interval: int = 1  # tokens per streamed event (vLLM's, raised to the server's --stream-interval)

    @property
    def prompt_len(self) -> int:
        """Over the batch's prompts, as vLLM's usage sums them."""
        return sum(self.prompt_lens)


def token_text(index: int) -> str:
    return _WORDS[(index - 1) % len(_WORDS)]


def check_request(kind: str, body: Mapping[str, Any], *, served_model: str) -> None:
    """What vLLM refuses before the engine is asked for room: the body's fields (its pydantic model), then an
    unknown model (404). A prompt's length is looked at only after the admission check (:func:`plan_request`)."""
    if body.get("stream_options") and not body.get("stream"):
        raise ApiError(
            400, "Stream options can only be defined when `stream=True`.", "BadRequestError", "stream_options"
        )
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool):
        raise ApiError(400, "n must be an integer", "BadRequestError", "n")
    if n != 1:
        raise ApiError(400, "n > 1 is not supported by the simulator", "BadRequestError", "n")
    check_model(body, served_model)


def check_model(body: Mapping[str, Any], served_model: str) -> None:
    """An unknown model is a 404; none (or null) is the served one, as vLLM has it."""
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def plan_request(
    kind: str,
    body: Mapping[str, Any],
    *,
    served_model: str,
    max_model_len: int,
    count_text: Callable[[str], int],
    count_chat: Callable[[Mapping[str, Any]], int],
) -> Plan:
    """Validate like vLLM once :func:`check_request` passed and the engine had room: a prompt that leaves no room
    for output is 400, a ``max_tokens`` larger than the context is 400, and one past it with the prompt is
    clamped to what is left."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", "BadRequestError", "messages")
        counts = [count_chat(body)]
    else:
        counts = [_count_prompt(prompt, count_text) for prompt in _prompts(body.get("prompt"))]
    truncate = body.get("truncate_prompt_tokens")
    if isinstance(truncate, int) and not isinstance(truncate, bool) and truncate >= -1:
        if truncate > max_model_len:
            raise ApiError(
                400,
                f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len = {max_model_len}.",
                "BadRequestError",
                "truncate_prompt_tokens",
            )
        # vLLM keeps that many of the prompt's tokens; -1: the context, less one token to generate
        counts = [min(n, max_model_len - 1 if truncate == -1 else truncate) for n in counts]
        if min(counts) < 1:
            raise ApiError(400, "The decoder prompt cannot be empty", "BadRequestError")
    # chat's max_completion_tokens, when not null, over max_tokens; completions have no such field
    raw_max = body.get("max_tokens")
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        raw_max = body["max_completion_tokens"]
    if raw_max is None and kind != "chat":
        raw_max = COMPLETIONS_DEFAULT_MAX_TOKENS  # vLLM's CompletionRequest default
    if raw_max is not None:
        if not isinstance(raw_max, int) or isinstance(raw_max, bool) or raw_max < 1:
            raise ApiError(400, "max_tokens must be at least 1", "BadRequestError", "max_tokens")
        if raw_max > max_model_len:  # vLLM's TokenizeParams: refused before the prompt is looked at
            raise ApiError(
                400,
                f"max_tokens={raw_max} cannot be greater than max_model_len={max_model_len}. "
                "Please request fewer output tokens.",
                "BadRequestError",
                "max_tokens",
            )
    budgets = [_budget(n, raw_max, max_model_len) for n in counts]
    min_tokens = _int_field(body, "min_tokens", minimum=0) or 0
    if min_tokens > min(budgets):
        raise ApiError(
            400,
            f"min_tokens must be less than or equal to max_tokens={min(budgets)}, got {min_tokens}.",
            "BadRequestError",
            "min_tokens",
        )
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise ApiError(400, "ignore_eos must be a boolean", "BadRequestError", "ignore_eos")
    natural = _int_field(body, SIM_OUTPUT_FIELD, minimum=1)
    stream = bool(body.get("stream", False))
    stream_interval = _int_field(body, "stream_interval", minimum=1) or 1
    options = body.get("stream_options") or {}
    include_usage = bool(stream and isinstance(options, Mapping) and options.get("include_usage"))
    return Plan(
        kind,
        tuple(counts),
        tuple(budgets),
        stream,
        include_usage,
        served_model,
        output_tokens=natural,
        min_tokens=min_tokens,
        ignore_eos=bool(ignore_eos),
        stream_interval=stream_interval,
    )


def _int_field(body: Mapping[str, Any], name: str, *, minimum: int) -> int | None:
    """An optional integer field (JSON null is absent); anything else, or below ``minimum``, is a 400."""
    raw = body.get(name)
    if raw is None:
        return None
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < minimum:
        raise ApiError(400, f"{name} must be an integer >= {minimum}", "BadRequestError", name)
    return raw


def _budget(prompt_len: int, raw_max: int | None, max_model_len: int) -> int:
    """One prompt's output budget, as vLLM's get_max_tokens: the context's rest without a cap, a cap past it
    clamped to it (not refused); a prompt that fills or passes the context is a 400."""
    if prompt_len > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{prompt_len} input tokens, which exceeds this limit even without any output tokens. Please reduce "
            "the length of the input prompt.",
            "BadRequestError",
            "input_tokens",
        )
    if prompt_len == max_model_len:  # fits, with no room left for output
        raise ApiError(400, "max_tokens must be at least 1, got 0.", "BadRequestError", "max_tokens")
    rest = max_model_len - prompt_len
    return rest if raw_max is None else min(raw_max, rest)


def _prompts(prompt: Any) -> list[Any]:
    """A completion's prompts, as vLLM reads its ``prompt``: a string or a list of token ids is one; a list of
    those is a batch, each its own engine request."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    if (
        isinstance(prompt, list)
        and prompt
        and (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt))
    ):
        return prompt  # strings, or lists of token ids: not both (vLLM's prompt types)
    raise ApiError(400, PROMPT_FORMS, "BadRequestError", "prompt")


def _count_prompt(prompt: Any, count_text: Callable[[str], int]) -> int:
    if isinstance(prompt, str):
        n = count_text(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        n = len(prompt)
    else:
        raise ApiError(400, PROMPT_FORMS, "BadRequestError", "prompt")
    if n < 1:
        raise ApiError(400, "The prompt cannot be empty.", "BadRequestError", "prompt")
    return n


class Renderer:
    """Builds one request's response objects (ids and timestamps fixed at creation)."""

    def __init__(self, plan: Plan, request_id: str) -> None:
        self.plan = plan
        self.id = request_id
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if plan.kind == "chat" else "text_completion"

    def usage(self, completion_tokens: int) -> dict[str, int]:
        p = self.plan.prompt_len
        return {
            "prompt_tokens": p,
            "completion_tokens": completion_tokens,
            "total_tokens": p + completion_tokens,
        }

    def chunk(self, index: int, finish_reason: str | None, last: int | None = None, choice: int = 0) -> bytes:
        """One SSE event carrying output tokens ``index`` to ``last`` (``index`` alone by default) of prompt
        ``choice`` (of a completions batch); an EOS (``stop``) token has no text, as in vLLM."""
        last = index if last is None else last
        shown = last - 1 if finish_reason == "stop" else last
        text = "".join(token_text(i) for i in range(index, shown + 1))
        if self.plan.kind == "chat":
            delta: dict[str, Any] = {"content": text}
            body: dict[str, Any] = {
                "index": choice,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            body = {
                "index": choice,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        obj = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.plan.model,
            "choices": [body],
        }
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def role_chunk(self) -> bytes:
        """A chat stream's first event, as vLLM sends it before any token: the role, and empty content."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        obj = {"id": self.id, "object": self.object, "created": self.created, "model": self.plan.model}
        return b"data: " + orjson.dumps({**obj, "choices": [choice]}) + b"\n\n"

    def usage_chunk(self, completion_tokens: int) -> bytes:
        obj = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.plan.model,
            "choices": [],
            "usage": self.usage(completion_tokens),
        }
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def full(self, outcomes: list[tuple[int, str]]) -> bytes:
        """The whole answer: one choice per prompt, from its (tokens produced, finish reason); usage summed."""
        choices: list[dict[str, Any]] = []
        for index, (produced, finish_reason) in enumerate(outcomes):
            words = produced - 1 if finish_reason == "stop" else produced  # EOS is counted, not shown
            text = "".join(token_text(i) for i in range(1, words + 1))
            if self.plan.kind == "chat":
                choices.append(
                    {
                        "index": index,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": finish_reason,
                        "stop_reason": None,
                    }
                )
            else:
                choices.append(
                    {
                        "index": index,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": finish_reason,
                        "stop_reason": None,
                    }
                )
        return orjson.dumps(
            {
                "id": self.id,
                "object": "chat.completion" if self.plan.kind == "chat" else "text_completion",
                "created": self.created,
                "model": self.plan.model,
                "choices": choices,
                "usage": self.usage(sum(produced for produced, _ in outcomes)),
            }
        )


def sse_error(err: ApiError) -> bytes:
    return b"data: " + err.body() + b"\n\n"


DONE = b"data: [DONE]\n\n"
