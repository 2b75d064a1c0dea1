"""What every run stands on: checkpoints and run files, metrics, fault handling, sharding,
multi-process helpers, static-shape bookkeeping, gin config checks.
"""
