"""Evaluation of a policy on held-out prompts.

  heldout.py      rollout + reward on held-out prompts, under the dense policy and the sparse
                  actor
  metrics.py      avg@n, unbiased pass@k, maj@k with standard errors over problems (pure)
  scorers.py      which reward scores a benchmark row (DAPO rule, math-verify), answers for votes
  run_samples.py  the sampling loop of `sparrow eval` (sparrow_jax.tools.evaluate); results.py
                  its files (per-chunk results, eval.json, fingerprints, TensorBoard names)
  reference.py    teacher-forced reference metrics: exact p(T=1 sample = reference), greedy
                  reproduction (no sampling noise)
"""
