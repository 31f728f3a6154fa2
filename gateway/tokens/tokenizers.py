"""Token counters: the pluggable part of cost estimation.

Four kinds, best first:

* ``hf:PATH``: a Hugging Face ``tokenizer.json`` (or a model directory holding one). Exact for the served
  model, and chat requests are rendered through the model's own chat template, as vLLM does. Like vLLM's own
  ``--tokenizer``, a bare directory, or a hub id (``org/name``, found in the Hugging Face cache: see
  :mod:`gateway.tokens.hub`), means the same.
* ``vllm``: the engine's own ``/tokenize`` endpoint. Exact, but costs a round trip per request.
* ``tiktoken:NAME_OR_FILE``: a tiktoken encoding by name (needs its cached file; nothing is downloaded at run
  time here) or from a local ``.tiktoken`` rank file.
* ``heuristic[:CHARS_PER_TOKEN]``: characters divided by a ratio. Never exact; always available.

``auto`` picks the best available at start-up and logs the choice (see :func:`gateway.tokens.resolve.build_counter`).
Local tokenizers are synchronous and thread-safe; the caller decides when to push them onto a thread, and says
so with ``off_loop=True``: moving work to a thread frees the event loop only if the work releases the GIL.

* ``tokenizers``: ``Tokenizer.encode`` holds the GIL for the whole encode (seconds for a 2 MB prompt), while
  ``encode_batch`` / ``encode_batch_fast`` run in Rust with the GIL released. Off the loop we call
  ``encode_batch_fast([text])`` (no offsets: the same ids, measurably less time with the GIL held when the
  ``Encoding`` is freed) and take ``len()`` of the ``Encoding`` rather than building a list of its ids. On the
  loop, for short text, ``encode`` is cheaper: releasing the GIL there would let a worker thread take it.
* ``tiktoken``: ``CoreBPE.encode`` / ``encode_ordinary`` release the GIL themselves (its ``encode_batch`` is
  only a Python thread pool over them), so calling them on a worker thread is already the equivalent.
* Chat templates are Jinja: pure Python, GIL held, but preemptible every switch interval, so they run on the
  same worker thread as the encode.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from gateway.protocol.errors import bad_request
from gateway.tokens import hub
from gateway.tokens.chat_render import content_format, conversation

Message = Mapping[str, Any]


class TokenizerUnavailable(Exception):
    """The requested tokenizer cannot be loaded; the message says what is missing and how to fix it."""


class LocalTokenizer(Protocol):
    """``off_loop``: the call runs on a worker thread, so it should release the GIL while it encodes.

    ``vocab_size``: token ids at or past it are out of vocabulary for the served model; None when this
    tokenizer is not the served model's own (then nothing is checked)."""

    name: str
    exact: bool
    vocab_size: int | None

    def encode(self, text: str) -> list[int]: ...

    def count(self, text: str, *, off_loop: bool = False, add_special_tokens: bool = True) -> int: ...

    def count_messages(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None = None,
        *,
        off_loop: bool = False,
        extra: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> int: ...


def message_text(message: Message) -> str:
    """The text of a chat message whose content is a string or a list of parts: text parts and bare strings
    (vLLM accepts both); other parts, and anything malformed, add nothing."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = (p if isinstance(p, str) else p.get("text") if isinstance(p, dict) else None for p in content)
        return "".join(t for t in texts if isinstance(t, str))
    return ""


# Per-message framing overhead when no chat template is known (OpenAI's published accounting for
# cl100k-style chat: 3 tokens per message, 1 for a name, 3 to prime the reply).
_PER_MESSAGE = 3
_PER_NAME = 1
_REPLY_PRIMING = 3


def _framed_count(
    count: Callable[[str], int],
    messages: Sequence[Message],
    tools: Sequence[Any] | None,
    extra: Mapping[str, Any] | None = None,
) -> int:
    total = _REPLY_PRIMING
    for m in messages:
        total += _PER_MESSAGE + count(message_text(m)) + count(str(m.get("role", "")))
        if m.get("name"):
            total += _PER_NAME + count(str(m["name"]))
        if m.get("tool_calls"):
            total += count(json.dumps(m["tool_calls"]))
    if tools:
        total += count(json.dumps(tools))
    if extra:  # documents and chat_template_kwargs: whatever the template would make of them, at least their text
        total += count(json.dumps(extra, default=str))
    return total


class HeuristicTokenizer:
    """``ceil(chars / chars_per_token)``. Pseudo token ids let a simulator answer /tokenize with it too."""

    exact = False
    vocab_size: int | None = None

    def __init__(self, chars_per_token: float = 4.0) -> None:
        if not math.isfinite(chars_per_token) or chars_per_token <= 0:
            raise TokenizerUnavailable("heuristic chars-per-token must be a positive number")
        self.chars_per_token = chars_per_token
        self.name = f"heuristic:{chars_per_token:g}"

    def count(self, text: str, *, off_loop: bool = False, add_special_tokens: bool = True) -> int:
        return math.ceil(len(text) / self.chars_per_token)

    def encode(self, text: str) -> list[int]:
        step = max(1, round(self.chars_per_token))
        return [
            int.from_bytes(hashlib.blake2b(text[i : i + step].encode(), digest_size=2).digest(), "big")
            for i in range(0, len(text), step)
        ][: self.count(text)]

    def count_messages(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None = None,
        *,
        off_loop: bool = False,
        extra: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> int:
        return _framed_count(self.count, messages, tools, extra)


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
    vocab_size: int | None = None  # ... so its vocabulary says nothing about which token ids the engine accepts

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
        # encode_ordinary == encode(disallowed_special=()): special-token text counts as plain text. Its Rust
        # core releases the GIL, on the loop or off it; only building the list of ids holds it.
        ids: list[int] = self._enc.encode_ordinary(text)
        return ids

    def count(self, text: str, *, off_loop: bool = False, add_special_tokens: bool = True) -> int:
        return len(self.encode(text))  # tiktoken's encodings add no special token of their own

    def count_messages(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None = None,
        *,
        off_loop: bool = False,
        extra: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> int:
        return _framed_count(self.count, messages, tools, extra)


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

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        special: dict[str, str],
        name: str,
        *,
        model_vocab_size: int | None = None,
    ) -> None:
        self._tok = tokenizer
        self._template = _compile_template(chat_template) if chat_template else None
        self._template_source = chat_template or ""
        self._content_format = content_format(chat_template) if chat_template else "string"
        self._special = special
        self.name = name
        self.has_chat_template = self._template is not None
        # Like vLLM: an id is in vocabulary up to the larger of the tokenizer's highest id and the model's
        # embedding size (config.json's vocab_size, often padded past the tokenizer's).
        vocab: dict[str, int] = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size: int | None = max(max(vocab.values(), default=-1) + 1, model_vocab_size or 0) or None
        # Releases the GIL while it encodes. ``encode_batch_fast`` (newer tokenizers) skips the offsets, which
        # also makes freeing the Encoding cheap: 2-30 ms with the GIL held per 2 MB prompt, not 100-400 ms.
        self._encode_released = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch

    @classmethod
    def load(cls, spec: str) -> HFTokenizer:
        from tokenizers import Tokenizer

        path = Path(spec)
        directory = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerUnavailable(
                f"no Hugging Face tokenizer at {spec!r}: expected a tokenizer.json file or a model directory "
                "containing one (mount the model directory, or name the model by its hub id)"
            )
        config: dict[str, Any] = {}
        config_file = directory / "tokenizer_config.json"
        try:
            tokenizer = Tokenizer.from_file(str(file))
            if config_file.is_file():
                config = json.loads(config_file.read_text(encoding="utf-8"))
        except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
            raise TokenizerUnavailable(f"cannot load the tokenizer at {spec!r}: {type(exc).__name__}: {exc}") from exc
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        model_vocab = _model_vocab_size(directory / "config.json")
        return cls(tokenizer, template, special, f"hf:{file}", model_vocab_size=model_vocab)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=True).ids
        return ids

    def _count(self, text: str, add_special_tokens: bool, off_loop: bool) -> int:
        """``encode`` holds the GIL from start to end: on a worker thread it would stall the event loop just
        the same. Off the loop, the batch call releases it; ``len(Encoding)`` avoids building a list of ids.
        Both give the same ids (tests/unit/test_tokenizer.py checks it)."""
        if off_loop:
            return len(self._encode_released([text], add_special_tokens=add_special_tokens)[0])
        return len(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def count(self, text: str, *, off_loop: bool = False, add_special_tokens: bool = True) -> int:
        return self._count(text, add_special_tokens, off_loop)

    def render_chat(
        self, messages: Sequence[Message], tools: Sequence[Any] | None = None, extra: Mapping[str, Any] | None = None
    ) -> str:
        """The prompt the engine would build. A template that refuses the messages (``raise_exception``, or
        a TypeError on content it did not expect) is the client's error: 400, as vLLM answers. ``extra``: the
        request's documents and chat_template_kwargs (the template reads those it names; the special tokens
        stay the tokenizer's)."""
        if self._template is None:
            raise TokenizerUnavailable(f"{self.name} has no chat template")
        from jinja2.exceptions import TemplateError

        try:
            own = ("messages", "tools", "add_generation_prompt")
            variables = {k: v for k, v in extra.items() if k not in self._special and k not in own} if extra else {}
            rendered: str = self._template.render(
                **variables,
                messages=conversation(messages, self._content_format, self._template_source),
                tools=tools,
                add_generation_prompt=True,
                **self._special,
            )
        except (TemplateError, ValueError, TypeError, OverflowError) as exc:
            raise bad_request(
                f"The model's chat template rejected the messages: {type(exc).__name__}: {exc}", param="messages"
            ) from None
        return rendered

    def count_messages(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None = None,
        *,
        off_loop: bool = False,
        extra: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> int:
        if self._template is None:
            return _framed_count(lambda text: self.count(text, off_loop=off_loop), messages, tools, extra)
        # vLLM tokenizes the rendered chat without adding special tokens again (the template has them), unless
        # the request says otherwise (add_special_tokens; the Responses API always does)
        return self._count(self.render_chat(messages, tools, extra), add_special_tokens, off_loop)


def _model_vocab_size(config_file: Path) -> int | None:
    """``vocab_size`` of the model's config.json (or of its text model's, for multimodal configs), if any."""
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config")) if isinstance(config, dict) else ():
        size = section.get("vocab_size") if isinstance(section, dict) else None
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None


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


SPECS = "auto, a model directory, a hub id (org/name), hf:PATH, tiktoken:NAME_OR_FILE, vllm or heuristic[:N]"


def load_tokenizer(spec: str) -> LocalTokenizer:
    """A local tokenizer from any spec but ``auto`` and ``vllm`` (see :func:`open_tokenizer`)."""
    return open_tokenizer(spec)[0]


def open_tokenizer(spec: str) -> tuple[LocalTokenizer, str]:
    """A local tokenizer, and where it came from (a bounded name: path, hf_cache, tiktoken_cache, builtin).

    ``hf:PATH``, ``tiktoken:NAME_OR_FILE``, ``heuristic[:N]``, and what vLLM's ``--tokenizer`` takes: a bare
    directory (or tokenizer.json), or a hub id looked up in the Hugging Face cache. Nothing is downloaded here
    (:func:`gateway.tokens.resolve.load_explicit` does, when allowed)."""
    kind, _, arg = spec.partition(":")
    if kind == "tiktoken":
        if not arg:
            raise TokenizerUnavailable("tiktoken: needs an encoding name or a .tiktoken file path")
        source = "path" if Path(arg).suffix == ".tiktoken" or Path(arg).exists() else "tiktoken_cache"
        return TiktokenTokenizer.load(arg), source
    if kind == "heuristic":
        try:
            return HeuristicTokenizer(float(arg) if arg else 4.0), "builtin"
        except ValueError as exc:
            raise TokenizerUnavailable(f"heuristic:{arg}: chars-per-token must be a number") from exc
    if kind == "hf" and not arg:
        raise TokenizerUnavailable("hf: needs a path or a hub id, e.g. hf:/models/llama-3-8b")
    target = arg if kind == "hf" else spec
    if not hub.is_repo_id(target) or Path(target).exists():
        if kind == "hf" or "/" in target or Path(target).exists():
            return HFTokenizer.load(target), "path"
        raise TokenizerUnavailable(f"unknown tokenizer spec {spec!r}: use {SPECS}")
    snapshot = hub.cached_snapshot(target)
    if snapshot is None:
        raise TokenizerUnavailable(
            f"no tokenizer for {target!r}: no such directory, and the Hugging Face cache at {hub.cache_dir()} "
            "has no snapshot of it with a tokenizer.json. Mount the model directory, or the HF cache vLLM uses "
            f"(set HF_HUB_CACHE or HF_HOME), or set tokenizer_download: true to fetch its tokenizer files; "
            f"specs: {SPECS}"
        )
    return HFTokenizer.load(str(snapshot)), "hf_cache"
