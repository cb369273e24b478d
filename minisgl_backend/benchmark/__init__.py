"""Shared pieces of the benchmark scripts in `scripts/bench_*.py`.

`shapes` (config.json of real and tiny model shapes), `workloads` (request sets), `hardware`
(copy bandwidth and the weight-read roofline), `timing` (per-request first-token and finish
times through the scheduler), `cli` (options and the Markdown table every script ends with).
"""
