"""Coding-agent harness adapters: each runs one unmodified harness against a proxy session."""
