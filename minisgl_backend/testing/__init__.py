"""Helpers for tests: tiny, self-contained artifacts that need no downloads."""
