"""Benchmarks for aiockpt against torch.save, safetensors, DCP and the machine's own limits.

Run ``python -m benchmarks --help`` from the repository root. Every case runs in one process on the same
in-memory states, so the figures in one report are directly comparable.
"""
