"""Reading a Triton request's input tensors as numpy arrays (inside Triton's stub only)."""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from minisgl_backend.serving.request import GetInput


def input_getter(request: Any) -> GetInput:
    """name -> the input as a numpy array, or None when the request does not carry it."""

    def get(name: str) -> np.ndarray | None:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    return get
