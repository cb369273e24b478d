"""Tensor-parallel-aware building blocks of the decoder models (torch reference implementations)."""
