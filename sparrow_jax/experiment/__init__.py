"""Experiments: several training arms side by side, and the offline schedule calibration.

  runner.py     `sparrow experiment`: arms x seeds, run one after another or in parallel
  paired.py     per-seed paired differences between arms, with confidence intervals
  calibrate.py  `sparrow calibrate`: per-bin budget sweep -> a certified schedule table
"""
