"""Quantized checkpoints and online quantization: FP8 weights (and their scales), FP8 inputs."""
