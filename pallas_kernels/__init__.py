"""Block-sparse and dense decode attention kernels (Pallas TPU, Pallas Triton, jax-triton) and their XLA references."""
