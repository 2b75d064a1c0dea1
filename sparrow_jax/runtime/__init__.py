"""What every run stands on: checkpoints and run files, a run's base model, metrics, fault
handling, sharding, multi-process helpers, static-shape bookkeeping, gin files and config checks.
"""
