"""Build the tiny random-weight Llama and its tokenizer that the e2e tests serve with vLLM.

Nothing may come from a model hub, so the model is made here: a 2-layer Llama (hidden 128, 4 heads of 32,
2 KV heads, vocab 4096) with seeded random weights, and a byte-level BPE trained with ``tokenizers`` on text
that ships with Python itself (the stdlib sources and licence). Random weights give gibberish, but with
``ignore_eos`` the engine produces exact lengths, which is all the KV-pressure tests need.

The tokenizer behaves like Llama 3's where it matters to a token-counting gateway: encoding adds a BOS token,
and the chat template starts with ``{{ bos_token }}``, so chat prompts must be encoded without special
tokens.

Run it with the engine venv's python (it needs transformers and torch)::

    .vllm-cpu/venv/bin/python tests/e2e/vllm_cpu/build_model.py [OUT_DIR]

It is idempotent: a stamp holding the hash of this file marks a finished build.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

SEED = 20261122
VOCAB_SIZE = 4096
MAX_POSITIONS = 2048
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
# ChatML framing, BOS first (like Llama 3). Accepts string content or OpenAI content-part lists.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
STAMP = ".kvgate-tiny-llama-built"


def default_out_dir() -> Path:
    """``$KVGATE_VLLM_CPU_DIR/tiny-llama``, default ``<repo>/.vllm-cpu/tiny-llama``."""
    repo = Path(__file__).resolve().parents[3]
    root = Path(os.environ.get("KVGATE_VLLM_CPU_DIR", repo / ".vllm-cpu"))
    return root / "tiny-llama"


def corpus() -> Iterator[str]:
    """Local training text, in a fixed order: the stdlib's top-level modules and its licence."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("LICENSE*")):
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def build_tokenizer(out: Path) -> None:
    """Train the byte-level BPE and save it as a transformers fast tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # Newer transformers put the template in chat_template.jinja only; tools that read tokenizer_config.json
    # (kvgate's hf: tokenizer among them) expect it there too, as older checkpoints have it.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    # transformers 5 writes its internal class name; the classic name loads everywhere (4.x, 5.x, vLLM).
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build_model(out: Path) -> None:
    """Save a seeded random-weight Llama whose head_dim (32) the CPU attention backend supports."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(out)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)


def source_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else default_out_dir()
    stamp = out / STAMP
    if stamp.exists() and stamp.read_text().strip() == source_hash():
        print(f"tiny model already built: {out}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.is_file():
            old.unlink()
    build_tokenizer(out)
    build_model(out)
    stamp.write_text(source_hash() + "\n")
    print(f"tiny model built: {out} ({sorted(p.name for p in out.iterdir())})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
