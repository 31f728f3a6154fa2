"""Helpers that build, start and stop a real vLLM CPU engine for the e2e tests (see docs/vllm-cpu.md)."""
