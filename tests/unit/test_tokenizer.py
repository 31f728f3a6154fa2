"""Tokenizers built inside the test: nothing is downloaded."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from pathlib import Path

import orjson
import pytest

from gateway.protocol.requests import parse_request
from gateway.tokens.counting import TokenCounter
from gateway.tokens.tokenizers import HFTokenizer, TiktokenTokenizer, TokenizerUnavailable, load_tokenizer

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [Path(__file__).read_text()] * 3 + ["the quick brown fox jumps over the lazy dog"] * 50
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    d = tmp_path_factory.mktemp("tiny-model")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE})
    )
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
    seen: list[str] = []
    tok = load_tokenizer(f"hf:{hf_dir}")
    original = tok.count

    def spy(text: str) -> int:
        seen.append(threading.current_thread().name)
        return original(text)

    tok.count = spy  # type: ignore[method-assign]
    counter = TokenCounter(tok, offload_chars=100)

    async def run() -> tuple[int, ...]:
        short = await counter.count(parse_request("completions", orjson.dumps({"prompt": "x" * 50})))
        long = await counter.count(parse_request("completions", orjson.dumps({"prompt": "the dog " * 100})))
        ids = await counter.count(parse_request("completions", orjson.dumps({"prompt": [1, 2, 3]})))
        return short + long + ids

    counts = asyncio.run(run())
    assert seen[0] == "MainThread" and seen[1].startswith("kvgate-tokenize")
    assert len(seen) == 2 and counts[2] == 3  # token ids are counted without the tokenizer
