"""Tokenizers built inside the test: nothing is downloaded."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from gateway.protocol.errors import GatewayError
from gateway.protocol.requests import parse_request
from gateway.tokens.counting import TokenCounter
from gateway.tokens.tokenizers import (
    HeuristicTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    TokenizerUnavailable,
    load_tokenizer,
)
from tests.support.bpe import build_bpe_dir

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = [Path(__file__).read_text()] * 3 + ["the quick brown fox jumps over the lazy dog"] * 50
    d = build_bpe_dir(tmp_path_factory.mktemp("tiny-model"), corpus, 400, CHAT_TEMPLATE)
    return d


def test_hf_counts_match_the_library(hf_dir: Path) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tok = load_tokenizer(f"hf:{hf_dir}")
    text = "the quick brown fox"
    assert tok.count(text) == len(raw.encode(text).ids) and tok.encode(text)[0] == 0  # BOS added
    assert tok.exact


def test_hf_chat_template_is_applied(hf_dir: Path) -> None:
    tok = load_tokenizer(f"hf:{hf_dir}")
    assert isinstance(tok, HFTokenizer) and tok.has_chat_template
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the lazy dog"}]
    rendered = tok.render_chat(messages)
    assert rendered == "<s><|system|>be brief<|end|><|user|>the lazy dog<|end|><|assistant|>"
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert tok.count_messages(messages) == len(raw.encode(rendered, add_special_tokens=False).ids)


def test_hf_missing_file_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(TokenizerUnavailable, match=r"tokenizer\.json"):
        load_tokenizer(f"hf:{tmp_path}")


def _rank_file(tmp_path: Path) -> Path:
    tokens = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the", b"er", b" l", b" la"]  # ranks 256..261
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    return path


def test_tiktoken_from_a_local_rank_file(tmp_path: Path) -> None:
    tok = load_tokenizer(f"tiktoken:{_rank_file(tmp_path)}")
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.encode("the") == [257]
    assert tok.encode(" the lazy") == [258, 261, ord("z"), ord("y")]  # " the" and " la" merge
    # 3 per message + "the" (1) + "user" (u, s, er: 3) + 3 to prime the reply
    assert tok.count_messages([{"role": "user", "content": "the"}]) == 3 + 1 + 3 + 3


def test_tiktoken_by_name_offline_explains_itself(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty cache: tiktoken would have to download
    import tiktoken.registry

    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.setattr("tiktoken.load.read_file", _no_network)
    with pytest.raises(TokenizerUnavailable, match="local rank file"):
        load_tokenizer("tiktoken:cl100k_base")


def _no_network(url: str) -> bytes:
    raise OSError(f"network unreachable: {url}")


def test_bad_specs() -> None:
    for spec in ("nope", "hf:", "tiktoken:", "heuristic:zero"):
        with pytest.raises(TokenizerUnavailable):
            load_tokenizer(spec)


def test_heuristic() -> None:
    tok = load_tokenizer("heuristic:2")
    assert tok.count("abcde") == 3 and len(tok.encode("abcde")) == 3 and not tok.exact


def test_long_prompts_are_tokenized_off_the_event_loop(hf_dir: Path) -> None:
    seen: list[tuple[str, bool]] = []
    tok = load_tokenizer(f"hf:{hf_dir}")
    original = tok.count

    def spy(text: str, *, off_loop: bool = False, add_special_tokens: bool = True) -> int:
        seen.append((threading.current_thread().name, off_loop))
        return original(text, off_loop=off_loop, add_special_tokens=add_special_tokens)

    tok.count = spy  # type: ignore[method-assign]
    counter = TokenCounter(tok, offload_chars=100)

    async def run() -> tuple[int, ...]:
        short = await counter.count(parse_request("completions", orjson.dumps({"prompt": "x" * 50})))
        long = await counter.count(parse_request("completions", orjson.dumps({"prompt": "the dog " * 100})))
        ids = await counter.count(parse_request("completions", orjson.dumps({"prompt": [1, 2, 3]})))
        return short + long + ids

    counts = asyncio.run(run())
    # inline on the loop with the GIL-holding encode; on a worker with the GIL-releasing one
    assert seen[0] == ("MainThread", False)
    assert seen[1][0].startswith("kvgate-tokenize") and seen[1][1] is True
    assert len(seen) == 2 and counts[2] == 3  # token ids are counted without the tokenizer


TEXTS = [
    "",
    "the quick brown fox",
    "  leading and trailing  ",
    "unicode: héllo wörld ☃ 日本語 🦊 \u00e9",
    "special tokens as text: <s> </s> <|end|>",
    "line\nbreaks\r\n\ttabs",
    "the lazy dog " * 500,
]


@pytest.mark.parametrize("text", TEXTS)
def test_hf_off_loop_counts_match_encode(hf_dir: Path, text: str) -> None:
    """The GIL-releasing batch call gives exactly the ids of ``encode``, with and without special tokens."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tok = load_tokenizer(f"hf:{hf_dir}")
    assert tok.count(text, off_loop=True) == tok.count(text) == len(raw.encode(text).ids)
    for fast in ("encode_batch_fast", "encode_batch"):
        if hasattr(raw, fast):
            batch = getattr(raw, fast)([text], add_special_tokens=False)[0]
            assert batch.ids == raw.encode(text, add_special_tokens=False).ids
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    assert tok.count_messages(messages, off_loop=True) == tok.count_messages(messages)


def test_tiny_llama_off_loop_counts_match_encode() -> None:
    """The e2e model's tokenizer (Llama-3-like: BOS added, ChatML template), when it has been built."""
    model = Path(__file__).resolve().parents[2] / ".vllm-cpu" / "tiny-llama"
    if not (model / "tokenizer.json").is_file():
        pytest.skip("tiny-llama not built (tests/e2e/vllm_cpu/build_model.py)")
    tok = load_tokenizer(f"hf:{model}")
    for text in TEXTS:
        assert tok.count(text, off_loop=True) == tok.count(text)
    assert tok.vocab_size == 4096


def _main_thread_gaps(work: Callable[[], object]) -> tuple[float, float]:
    """Run ``work`` on a thread while this thread ticks every millisecond: (longest gap between ticks, time the
    work took). A call that holds the GIL leaves one gap as long as itself."""
    done: list[float] = []

    def run() -> None:
        t0 = time.perf_counter()
        work()
        done.append(time.perf_counter() - t0)

    thread = threading.Thread(target=run)
    gaps = []
    last = time.perf_counter()
    thread.start()
    while thread.is_alive():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    thread.join()
    return max(gaps), done[0]


def test_hf_off_loop_count_releases_the_gil(hf_dir: Path) -> None:
    """``Tokenizer.encode`` holds the GIL for the whole encode, so a worker thread running it stalls the event
    loop as much as the loop running it; the off-loop count must leave the GIL to the loop."""
    tok = load_tokenizer(f"hf:{hf_dir}")
    text = "the quick brown fox jumps over the lazy dog; " * 25_000  # 1.1 MB
    held_gap, held_took = _main_thread_gaps(lambda: tok.count(text))
    assert held_gap > 0.8 * held_took  # the premise: encode holds the GIL throughout
    gap, took = _main_thread_gaps(lambda: tok.count(text, off_loop=True))
    assert gap < 0.5 * took and gap < 0.25, f"main thread stalled {gap * 1e3:.0f} ms of a {took * 1e3:.0f} ms count"


def test_tiktoken_encode_releases_the_gil(tmp_path: Path) -> None:
    """tiktoken's Rust core releases the GIL itself (its encode_batch is just a thread pool over encode)."""
    tok = load_tokenizer(f"tiktoken:{_rank_file(tmp_path)}")
    text = "the lazy dog, the quick fox. " * 40_000
    gap, took = _main_thread_gaps(lambda: tok.count(text, off_loop=True))
    assert gap < 0.5 * took, f"main thread stalled {gap * 1e3:.0f} ms of a {took * 1e3:.0f} ms count"


RAISING_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] + '' }}<|end|>{% endfor %}"
)


def test_a_template_that_refuses_the_messages_is_a_400(hf_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = HFTokenizer(Tokenizer.from_file(str(hf_dir / "tokenizer.json")), RAISING_TEMPLATE, {}, "hf:raising")
    assert tok.count_messages([{"role": "user", "content": "hi"}]) > 0
    with pytest.raises(GatewayError) as err:
        tok.count_messages([{"role": "assistant", "content": "hi"}], off_loop=True)
    assert (err.value.status, err.value.type, err.value.param) == (400, "invalid_request_error", "messages")
    assert "roles must alternate" in err.value.message
    # parts are joined for a template that does not loop over content, as vLLM joins them: no TypeError
    assert tok.render_chat([{"role": "user", "content": [{"type": "text", "text": "h"}, "i"]}]) == "<|user|>h\ni<|end|>"
    adding = HFTokenizer(Tokenizer.from_file(str(hf_dir / "tokenizer.json")), "{{ tools + '' }}", {}, "hf:adding")
    with pytest.raises(GatewayError) as err:  # a TypeError inside the template (list + str) is the client's too
        adding.count_messages([{"role": "user", "content": "hi"}], [{"type": "function"}])
    assert err.value.status == 400


def test_vocabulary_size_only_for_the_served_models_tokenizer(hf_dir: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    highest = max(raw.get_vocab(with_added_tokens=True).values())
    assert load_tokenizer(f"hf:{hf_dir}").vocab_size == highest + 1
    # the model's embedding (config.json) may be padded past the tokenizer's ids: vLLM accepts up to it
    padded = tmp_path / "padded"
    padded.mkdir()
    (padded / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    (padded / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 512}}))
    assert load_tokenizer(f"hf:{padded}").vocab_size == 512
    assert load_tokenizer(f"tiktoken:{_rank_file(tmp_path)}").vocab_size is None  # not the served model's
    assert load_tokenizer("heuristic").vocab_size is None


def test_documents_and_template_kwargs_are_counted_as_part_of_the_prompt(tmp_path: Path) -> None:
    """A RAG template renders the request's documents and reads its chat_template_kwargs: the local count
    renders them too. The variables kvgate sets itself (the messages, the special tokens) stay its own. Without
    a template, their text is counted."""
    template = (
        "{{ bos_token }}{% for d in documents or [] %}<|doc|>{{ d['text'] }}{% endfor %}"
        "{% if persona %}<|system|>{{ persona }}{% endif %}"
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}<|assistant|>"
    )
    corpus = ["the quick brown fox jumps over the lazy dog"] * 50
    tok = load_tokenizer(f"hf:{build_bpe_dir(tmp_path, corpus, 300, template)}")
    assert isinstance(tok, HFTokenizer)
    messages = [{"role": "user", "content": "the fox"}]
    extra = {"documents": [{"text": "the lazy dog"}], "persona": "brown", "bos_token": "x", "messages": []}
    rendered = tok.render_chat(messages, None, extra)
    assert rendered == "<s><|doc|>the lazy dog<|system|>brown<|user|>the fox<|end|><|assistant|>"
    assert tok.count_messages(messages, extra=extra) > tok.count_messages(messages)
    plain = HeuristicTokenizer(4.0)
    long_docs = {"documents": [{"text": "d" * 4000}]}
    assert plain.count_messages(messages, extra=long_docs) >= plain.count_messages(messages) + 1000
