"""Benchmarks (`sparrow bench ...`): kernels, rollout tokens/s, the long-tail paged workload,
KV compression. They import the engines; nothing imports them.
"""
