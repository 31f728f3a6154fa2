"""Tokens and what they cost: tokenizers, counting a request's prompt tokens, and its KV-block cost.

Owns: :mod:`.tokenizers` (hf / tiktoken / heuristic, chat templates), :mod:`.hub` (tokenizer files in the
Hugging Face cache, and downloading them there), :mod:`.resolve` (which counter: explicit spec or ``auto``),
:mod:`.counting` (count a parsed request without stalling the loop, or ask the engine's /tokenize, with
:mod:`.count_cache` for repeated requests), :mod:`.cost` (tokens -> KV blocks, pure), :mod:`.prompt_estimate`
(a text prompt's token band, learned from the engine's counts, pure), :mod:`.conversations` (exact counts of
earlier turns of a chat, pure), :mod:`.estimator` (the cost step: prices text far from every limit by that
band's high end, or by an earlier turn's count and the new messages' band, counts it near one).
May import: :mod:`gateway.protocol`, :mod:`gateway.config`.
"""
