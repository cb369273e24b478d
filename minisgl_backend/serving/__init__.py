"""The Triton side: Python-backend models (preprocessing, the decoupled engine model) and the
request parsing and settings they share. Nothing here imports `triton_python_backend_utils` at
import time except the model classes, which only run inside Triton's stub.

Triton's Python-backend stub starts its interpreter without reading PYTHONPATH (checked with
tritonserver 2.51: the variable is in the stub's environment, its entries are not on
`sys.path`). Packages that a user makes importable through it (installed with
`pip install --target DIR`, say FlashInfer) would then be missing in the models and in the
engine processes they spawn (which inherit `sys.path`), and the engine would silently fall back
to slower kernels. Importing this package adds PYTHONPATH's entries, first, as `python` does;
elsewhere they are already there and nothing changes.
"""

from __future__ import annotations

import os
import sys


def honor_pythonpath() -> list[str]:
    """Put PYTHONPATH's entries missing from `sys.path` at its front; returns those added."""
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    added = [p for p in dict.fromkeys(entries) if p not in sys.path]
    sys.path[:0] = added
    return added


honor_pythonpath()
