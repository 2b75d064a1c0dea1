"""Commands that use a model outside training.

  generate.py    `sparrow rollout`: completions for a prompt file (dense or sparse)
  export.py      `sparrow export`: a training checkpoint -> a Hugging Face directory
  evaluate.py    `sparrow eval`: avg@n, pass@k, maj@k of a model or a run's checkpoint
  data_check.py  `sparrow data check`: a prompt set against the model's tokenizer and reward
  doctor.py      `sparrow doctor`: kernels against the XLA reference and a rollout, on this device
"""
