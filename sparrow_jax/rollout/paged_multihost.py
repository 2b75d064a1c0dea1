"""Multi-process paged rollouts: the same deterministic host scheduler runs on every process.

Design (docs/rollout.md#several-hosts): every process gathers the step's *global* prompts (each
process's prompt rows, integer arrays, in process order), runs the identical scheduler
(`rollout/continuous.py`: integer state, order-stable decisions, no set/dict iteration order,
no float ties) and dispatches the same global programs over the global mesh. What a program
returns and the scheduler needs (tokens, log-probs, recorded flags) is read back fully replicated
(`multihost.to_host`), so every process records the same values and takes the same next
decisions. Host inputs become global arrays without a collective (`multihost.host_to_global`:
each process copies only its own devices' slices).

`Coordination` makes a divergence fail loudly instead of hanging in a collective or silently mixing
page tables: every host input of a program is hashed (64 bits: CRC-32 and Adler-32 over shapes,
dtypes and bytes of slot tables, page tables, admitted samples' rows - accidental differences,
not adversaries, and ~4x cheaper than blake2b), and before each dispatch the processes
exchange their digests on the host (`multihost.host_allgather`: jax.distributed's coordination
service, no device program - so a check made while a decode chunk runs does not wait for it,
and the overlapped loop works across processes as on one); on a mismatch every process raises
`SchedulerDivergence` naming the program, the decode chunk and each process's digest.

The device programs every process dispatches - prefills, decode chunks and the replicating
readbacks - are the same, in the same order, on every process (XLA launches programs with
collectives one at a time, in dispatch order), so their collectives pair.
"""

from __future__ import annotations

import time
import zlib

import jax
import numpy as np

from sparrow_jax.runtime import multihost
from sparrow_jax.runtime.sharding import ShardingSpec


class SchedulerDivergence(RuntimeError):
    """The processes' host schedulers built different program inputs."""


def global_prompts(prompt_tokens: np.ndarray, prompt_lengths: np.ndarray,
                   spec: ShardingSpec | None) -> tuple[np.ndarray, np.ndarray]:
    """Every process's prompts (already padded to one width) -> the global prompt list, process
    p's prompts being block p (the rows the static engine gives it). Identity with one
    process."""
    if not multihost.is_multiprocess():
        return prompt_tokens, prompt_lengths
    multihost.check_mesh(spec)          # process p's rows must live on p's devices
    counts = multihost.all_rows(np.asarray([prompt_tokens.shape[0]], np.int32))
    if (counts != counts[0]).any():
        raise ValueError(f"every process must pass the same number of prompts to a multi-process "
                         f"rollout; prompts per process: {counts.tolist()}")
    return (multihost.all_rows(prompt_tokens).astype(np.int32),
            multihost.all_rows(prompt_lengths).astype(np.int32))


class Coordination:
    """The scheduler's cross-process steps: a digest check of every program's host inputs
    before its dispatch, and replicated readbacks of its results (one process: plain reads)."""

    def __init__(self, spec: ShardingSpec | None) -> None:
        self.enabled = multihost.is_multiprocess()
        self.spec = spec
        self._crc, self._adler = 0, 1
        self.checks = 0
        self.check_seconds = 0.0     # in the digest allgathers
        self.read_seconds = 0.0      # in replicated readbacks (after the results were computed)

    def read_back(self, outs):
        """A program's outputs the scheduler records, whole on every process."""
        return self.finish_read(self.start_read(outs))

    def start_read(self, outs):
        """Starts reading a just-dispatched program's outputs back, before anything else is
        dispatched (a later program must not delay it): the device-to-host copies (several
        processes: the replicating program, dispatched now). `finish_read` waits for it."""
        if self.enabled:
            outs = multihost.replicate(outs, self.spec)
        for x in jax.tree.leaves(outs):
            (x.addressable_data(0) if self.enabled else x).copy_to_host_async()
        return outs

    def finish_read(self, started):
        """The NumPy values of `start_read(outs)`, whole on every process."""
        if not self.enabled:
            return jax.tree.map(np.asarray, started)
        started = jax.block_until_ready(started)      # time the gather, not the program
        start = time.perf_counter()
        host = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), started)
        self.read_seconds += time.perf_counter() - start
        return host

    def add(self, x: np.ndarray) -> None:
        """Folds one host input of the next program into the pending digest."""
        if self.enabled:
            x = np.ascontiguousarray(x)
            for part in (f"{x.dtype.str}{x.shape}".encode(), x.data):
                self._crc = zlib.crc32(part, self._crc)
                self._adler = zlib.adler32(part, self._adler)

    def check(self, program: str, chunk: int) -> None:
        """Compares the pending digest across processes; raises SchedulerDivergence (on every
        process alike: all of them see all digests) at the first difference."""
        if not self.enabled:
            return
        digest = np.asarray([self._crc, self._adler], np.uint32).view(np.int32)
        self._crc, self._adler = 0, 1
        # [check, chunk, crc, adler] as int32 words (the digest's two uint32s viewed as such).
        mine = np.concatenate([np.asarray([self.checks, chunk], np.int32), digest])
        start = time.perf_counter()
        # On the host (the coordination service), not a device allgather: a check made while a
        # chunk runs must not queue behind it (the overlapped loop dispatches the next chunk
        # before reading the running one back).
        everyone = np.stack([np.frombuffer(b, np.int32) for b in
                             multihost.host_allgather("paged_rollout", mine.tobytes())])
        self.check_seconds += time.perf_counter() - start
        self.checks += 1
        if (everyone != everyone[0]).any():
            digests = ", ".join(f"process {p}: 0x{row[2:].astype('<i4').tobytes().hex()}"
                                f" (check {row[0]}, chunk {row[1]})"
                                for p, row in enumerate(everyone))
            raise SchedulerDivergence(
                f"paged rollout: the host schedulers diverged before the {program} program of "
                f"decode chunk {chunk} (the first difference: every dispatch is checked); input "
                f"digests: {digests}. Every process must build identical inputs from the same "
                "prompts and chunk results - non-deterministic host code or different code or "
                "config versions on the hosts. Stopped before dispatching, so no collective "
                "hangs.")
