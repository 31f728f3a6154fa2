"""kvgate: a KV-cache-aware admission gateway in front of vLLM."""

__version__ = "0.1.0"
