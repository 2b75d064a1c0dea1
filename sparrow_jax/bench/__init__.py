"""Benchmarks (`sparrow bench ...`): kernels and rollout tokens/s (each beside its bytes limit),
the long-tail and RL-shaped paged workloads, KV compression. They import the engines; nothing
imports them.
"""
