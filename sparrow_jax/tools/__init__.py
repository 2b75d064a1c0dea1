"""Commands that use a model outside training.

  generate.py  `sparrow rollout`: completions for a prompt file (dense or sparse)
  export.py    `sparrow export`: a training checkpoint -> a Hugging Face directory
  doctor.py    `sparrow doctor`: kernels against the XLA reference and a rollout, on this device
"""
