"""Token counters: the pluggable part of cost estimation.

Four kinds, best first:

* ``hf:PATH``: a Hugging Face ``tokenizer.json`` (or a model directory holding one). Exact for the served
  model, and chat requests are rendered through the model's own chat template, as vLLM does.
* ``vllm``: the engine's own ``/tokenize`` endpoint. Exact, but costs a round trip per request.
* ``tiktoken:NAME_OR_FILE``: a tiktoken encoding by name (needs its cached file; nothing is downloaded at run
  time here) or from a local ``.tiktoken`` rank file.
* ``heuristic[:CHARS_PER_TOKEN]``: characters divided by a ratio. Never exact; always available.

``auto`` picks the best available at start-up and logs the choice (see :func:`gateway.tokens.cost.build_counter`).
Local tokenizers are synchronous and thread-safe; the caller decides when to push them onto a thread.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

Message = Mapping[str, Any]


class TokenizerUnavailable(Exception):
    """The requested tokenizer cannot be loaded; the message says what is missing and how to fix it."""


class LocalTokenizer(Protocol):
    name: str
    exact: bool

    def encode(self, text: str) -> list[int]: ...

    def count(self, text: str) -> int: ...

    def count_messages(self, messages: Sequence[Message], tools: Sequence[Any] | None = None) -> int: ...


def message_text(message: Message) -> str:
    """The text of a chat message whose content is a string or a list of parts (non-text parts ignored)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


# Per-message framing overhead when no chat template is known (OpenAI's published accounting for
# cl100k-style chat: 3 tokens per message, 1 for a name, 3 to prime the reply).
_PER_MESSAGE = 3
_PER_NAME = 1
_REPLY_PRIMING = 3


def _framed_count(count: Any, messages: Sequence[Message], tools: Sequence[Any] | None) -> int:
    total = _REPLY_PRIMING
    for m in messages:
        total += _PER_MESSAGE + count(message_text(m)) + count(str(m.get("role", "")))
        if m.get("name"):
            total += _PER_NAME + count(str(m["name"]))
        if m.get("tool_calls"):
            total += count(json.dumps(m["tool_calls"]))
    if tools:
        total += count(json.dumps(tools))
    return total


class HeuristicTokenizer:
    """``ceil(chars / chars_per_token)``. Pseudo token ids let a simulator answer /tokenize with it too."""

    exact = False

    def __init__(self, chars_per_token: float = 4.0) -> None:
        if chars_per_token <= 0:
            raise TokenizerUnavailable("heuristic chars-per-token must be positive")
        self.chars_per_token = chars_per_token
        self.name = f"heuristic:{chars_per_token:g}"

    def count(self, text: str) -> int:
        return math.ceil(len(text) / self.chars_per_token)

    def encode(self, text: str) -> list[int]:
        step = max(1, round(self.chars_per_token))
        return [
            int.from_bytes(hashlib.blake2b(text[i : i + step].encode(), digest_size=2).digest(), "big")
            for i in range(0, len(text), step)
        ][: self.count(text)]

    def count_messages(self, messages: Sequence[Message], tools: Sequence[Any] | None = None) -> int:
        return _framed_count(self.count, messages, tools)


# The split patterns of OpenAI's published encodings (from tiktoken_ext/openai_public.py).
_CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


class TiktokenTokenizer:
    """A tiktoken ``Encoding``, by name or from a local ``.tiktoken`` file (base64 token, rank per line)."""

    exact = False  # tiktoken matches OpenAI models, not the open models vLLM usually serves.

    def __init__(self, encoding: Any, name: str) -> None:
        self._enc = encoding
        self.name = name

    @classmethod
    def load(cls, spec: str) -> TiktokenTokenizer:
        import tiktoken

        path = Path(spec)
        if path.suffix == ".tiktoken" or path.exists():
            if not path.is_file():
                raise TokenizerUnavailable(f"tiktoken rank file {spec!r} does not exist")
            ranks = _load_ranks(path)
            pattern = _O200K_PATTERN if "o200k" in path.name else _CL100K_PATTERN
            enc = tiktoken.Encoding(
                name=path.stem,
                pat_str=pattern,
                mergeable_ranks=ranks,
                special_tokens={"<|endoftext|>": len(ranks)},
            )
            return cls(enc, f"tiktoken:{path}")
        try:
            enc = tiktoken.get_encoding(spec)
        except Exception as exc:  # tiktoken raises ValueError, or a network error when the file is not cached
            raise TokenizerUnavailable(
                f"tiktoken encoding {spec!r} could not be loaded ({type(exc).__name__}: {exc}). tiktoken "
                "downloads encodings on first use; on an offline machine pass a local rank file instead, "
                "e.g. --tokenizer tiktoken:/models/cl100k_base.tiktoken, or pre-populate TIKTOKEN_CACHE_DIR."
            ) from exc
        return cls(enc, f"tiktoken:{spec}")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._enc.encode(text, disallowed_special=())
        return ids

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def count_messages(self, messages: Sequence[Message], tools: Sequence[Any] | None = None) -> int:
        return _framed_count(self.count, messages, tools)


def _load_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError as exc:
            raise TokenizerUnavailable(f"{path}:{lineno}: expected '<base64 token> <rank>'") from exc
    if not ranks:
        raise TokenizerUnavailable(f"{path}: no ranks in the file")
    return ranks


class HFTokenizer:
    """A Hugging Face fast tokenizer with the model's chat template, without importing transformers."""

    exact = True

    def __init__(self, tokenizer: Any, chat_template: str | None, special: dict[str, str], name: str) -> None:
        self._tok = tokenizer
        self._template = _compile_template(chat_template) if chat_template else None
        self._special = special
        self.name = name
        self.has_chat_template = self._template is not None

    @classmethod
    def load(cls, spec: str) -> HFTokenizer:
        from tokenizers import Tokenizer

        path = Path(spec)
        directory = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerUnavailable(
                f"no Hugging Face tokenizer at {spec!r}: expected a tokenizer.json file or a model directory "
                "containing one (models are never downloaded at run time; mount the model directory)"
            )
        tokenizer = Tokenizer.from_file(str(file))
        config: dict[str, Any] = {}
        config_file = directory / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return cls(tokenizer, template, special, f"hf:{file}")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=True).ids
        return ids

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=True).ids)

    def render_chat(self, messages: Sequence[Message], tools: Sequence[Any] | None = None) -> str:
        if self._template is None:
            raise TokenizerUnavailable(f"{self.name} has no chat template")
        rendered: str = self._template.render(
            messages=list(messages), tools=tools, add_generation_prompt=True, **self._special
        )
        return rendered

    def count_messages(self, messages: Sequence[Message], tools: Sequence[Any] | None = None) -> int:
        if self._template is None:
            return _framed_count(self.count, messages, tools)
        # vLLM tokenizes the rendered chat without adding special tokens again: the template has them.
        return len(self._tok.encode(self.render_chat(messages, tools), add_special_tokens=False).ids)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _compile_template(source: str) -> Any:
    """Compile a chat template the way transformers does: sandboxed, trimmed, with its helper functions."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def load_tokenizer(spec: str) -> LocalTokenizer:
    """Load a local tokenizer from ``hf:PATH``, ``tiktoken:NAME_OR_FILE`` or ``heuristic[:N]``."""
    kind, _, arg = spec.partition(":")
    if kind == "hf":
        if not arg:
            raise TokenizerUnavailable("hf: needs a path, e.g. hf:/models/llama-3-8b")
        return HFTokenizer.load(arg)
    if kind == "tiktoken":
        if not arg:
            raise TokenizerUnavailable("tiktoken: needs an encoding name or a .tiktoken file path")
        return TiktokenTokenizer.load(arg)
    if kind == "heuristic":
        try:
            return HeuristicTokenizer(float(arg) if arg else 4.0)
        except ValueError as exc:
            raise TokenizerUnavailable(f"heuristic:{arg}: chars-per-token must be a number") from exc
    raise TokenizerUnavailable(
        f"unknown tokenizer spec {spec!r}: use auto, hf:PATH, tiktoken:NAME_OR_FILE, vllm or heuristic[:N]"
    )
