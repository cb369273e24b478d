"""The Triton side: Python-backend models (preprocessing, the decoupled engine model) and the
request parsing and settings they share. Nothing here imports `triton_python_backend_utils` at
import time except the model classes, which only run inside Triton's stub."""
