"""The device's ceilings, measured: copy bandwidth (the denominator of every bytes limit) and
the bf16 matrix rate (the learner's FLOP/s is a share of it).

A decode step reads its weights and KV once; the fastest it can go is those bytes over the
bandwidth a plain copy reaches on the same device (`sparsity.cost_model.decode_step_bytes`).
`sparrow bench kernel`, `sparrow bench rollout` and `sparrow doctor` measure it with this one
function, in the same process as the timings they compare against it. `sparrow doctor` also
measures the matrix rate on an accelerator (`matmul_rate`), so every device report records both.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

__all__ = ["copy_bandwidth", "default_probe_bytes", "matmul_rate", "median_wall_seconds"]


def default_probe_bytes() -> int:
    """The probe's buffer: 256 MiB on CPU (well past its caches), 2 GiB on an accelerator."""
    return (256 if jax.default_backend() == "cpu" else 2048) << 20


def copy_bandwidth(nbytes: int | None = None, iters: int = 10) -> float:
    """Bytes/s of a large in-place elementwise update (read + write, both counted): the
    practical bandwidth ceiling, the median of `iters` timed calls after one that compiles.
    The buffer is donated so every call reuses it: a fresh output allocation would measure
    page-fault (first-touch) cost on CPU instead of memory bandwidth."""
    nbytes = nbytes or default_probe_bytes()
    f = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    x = jax.block_until_ready(f(jnp.ones((nbytes // 4,), jnp.float32)))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        x = jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / statistics.median(times)


def median_wall_seconds(fn, *args, iters: int) -> float:
    """Median wall time (s) of fn(*args) after a warmup call (which also compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_rate(n: int = 8192, products: int = 10, iters: int = 5,
                dtype=jnp.bfloat16) -> float:
    """FLOP/s of `products` chained n x n x n products in one program on random data (the
    ceiling a learner's model FLOP/s is a share of), the median of `iters` timed calls after
    one that compiles. Each product is rescaled by 1/sqrt(n) so the values stay O(1): a rate
    on zeros or infinities is not a rate on data (an H200 multiplies zeros ~13% faster)."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    scale = jnp.asarray(n ** -0.5, dtype)

    @jax.jit
    def chain(a, b):
        return jax.lax.fori_loop(0, products, lambda _, c: (c @ b) * scale, a)
    return products * 2 * n ** 3 / median_wall_seconds(chain, a, b, iters=iters)
