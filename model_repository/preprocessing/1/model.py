"""Triton entry point of the `preprocessing` model (the code lives in minisgl_backend)."""

import sys
from pathlib import Path

try:
    import minisgl_backend  # noqa: F401
except ImportError:  # not installed: use the source tree this repository belongs to
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from minisgl_backend.serving.preprocess_model import TritonPythonModel  # noqa: E402,F401
