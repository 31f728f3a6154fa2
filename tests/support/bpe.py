"""A small byte-level BPE model directory, trained in the test itself (nothing is downloaded): ``tokenizer.json``
with ``<s>`` as BOS, and ``tokenizer_config.json`` with a chat template, as a Hugging Face model ships them."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path


def build_bpe_dir(directory: Path, corpus: Iterable[str], vocab_size: int, chat_template: str) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": chat_template})
    )
    return directory
