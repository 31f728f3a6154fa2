"""Tokens and what they cost: tokenizers, counting a request's prompt tokens, and its KV-block cost.

Owns: :mod:`.tokenizers` (hf / tiktoken / heuristic, chat templates), :mod:`.counting` (count a parsed
request without stalling the loop, or ask the engine's /tokenize), :mod:`.cost` (tokens -> KV blocks, pure).
May import: :mod:`gateway.protocol`, :mod:`gateway.config`.
"""
