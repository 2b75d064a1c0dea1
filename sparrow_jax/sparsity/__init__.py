"""The method's math and policy: block selection, the acceptance-rate mismatch, per-bin
schedules and their controller, the eFLOPs cost model, calibration sweeps, KV-eviction scores.
"""
