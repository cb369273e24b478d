"""The engine side: one process per tensor-parallel rank (model, KV pool, tables, sampling)."""

from minisgl_backend.engine.config import EngineConfig

__all__ = ["EngineConfig"]
