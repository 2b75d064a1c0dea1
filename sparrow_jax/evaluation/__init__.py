"""Evaluation of a policy on held-out prompts.

  heldout.py    rollout + reward on held-out prompts, under the dense policy and the sparse actor
  reference.py  teacher-forced reference metrics: exact p(T=1 sample = reference), greedy
                reproduction (no sampling noise)
"""
