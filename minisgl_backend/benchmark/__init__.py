"""The benchmark tool: `python -m minisgl_backend.benchmark SUBCOMMAND` (docs/benchmarks.md).

One module per subcommand (offline, decode, serving, controls, structured, speculative, fp8,
kernels, scheduler, suite, pack); `cli` holds what they share, `shapes`, `tokenizer` and
`workloads` the models and requests they run, `hardware` the bandwidth roofline.
"""
