"""Block-sparse and dense decode attention kernels (Pallas TPU, Pallas Triton, jax-triton)
and their XLA references. Entry points: ``block_sparse_decode`` and ``dense_decode``."""

from pallas_kernels.dispatch import (BACKENDS, BackendUnavailableError, block_sparse_decode,
                                     dense_decode, paged_block_sparse_decode,
                                     paged_covered_decode, paged_dense_decode, resolve_backend)
from pallas_kernels.reference import SelectedPages

__all__ = ["BACKENDS", "BackendUnavailableError", "SelectedPages", "block_sparse_decode",
           "dense_decode", "paged_block_sparse_decode", "paged_covered_decode",
           "paged_dense_decode", "resolve_backend"]
