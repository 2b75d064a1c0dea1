"""One process of a local multi-process paged rollout (launched by tests/test_multihost_paged.py).

    python tests/multihost_paged_worker.py ROLE ROOT PROCESS_ID NUM_PROCESSES PORT

ROLE: `rollout` (every case of ROOT/cases.json, then the first again as `again`; rows and stats
to ROOT/<case>_<pid>.npz/json), `diverge` (the first case, process 1 putting its running samples
in another slot order at its second decode chunk: a non-deterministic scheduler), `kill` (the
first case; process 1 SIGKILLs itself before its second decode chunk, after writing
ROOT/killed_at).
Each process has 4 CPU devices (XLA_FLAGS set by the launcher) on a data=2 x model=4 mesh: one
data shard (one page pool) per process, as on a pod whose model axis is a host's chips.
"""

import faulthandler
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

HEARTBEAT_SECONDS = 10       # the `kill` role: how soon a dead peer is noticed


def _sabotage(role: str, pid: int, root: Path) -> None:
    """Process 1 misbehaves from its second decode chunk on (the first has run everywhere)."""
    from sparrow_jax.rollout import continuous
    decode, chunks = continuous.PagedRollout.decode, [0]

    def second_chunk_differs(self, budgets, pending=None):
        chunks[0] += 1
        if chunks[0] == 2 and role == "diverge":
            # A non-deterministic scheduler: its samples' pages in another order (in the page
            # tables of a fresh chunk and of a continuation alike).
            for s in (s for r in self.running for s in r):
                s.pages = s.pages[::-1]
        if chunks[0] == 2 and role == "kill":
            (root / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return decode(self, budgets, pending)

    if pid == 1 and role in ("diverge", "kill"):
        continuous.PagedRollout.decode = second_chunk_differs


def main(role: str, root: Path, pid: int, nproc: int, port: int) -> None:
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid,
                               heartbeat_timeout_seconds=HEARTBEAT_SECONDS,
                               shutdown_timeout_seconds=30)
    from hf_fixtures import process_prompts
    from sparrow_jax.model import load_hf
    from sparrow_jax.rollout import RolloutConfig, continuous, generate
    from sparrow_jax.runtime import multihost
    from sparrow_jax.runtime.sharding import ShardingSpec, make_mesh

    _sabotage(role, pid, root)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    spec = ShardingSpec.create(make_mesh(model=4))
    model = load_hf(root / "model", mesh=spec.mesh)
    tokens, lengths = process_prompts(root, pid, nproc)     # ragged widths per process
    cases = json.loads((root / "cases.json").read_text())
    # `rollout`: every case, then the first again with its programs compiled (the steady-state
    # cost of the cross-process coordination per decode chunk, printed by the test). The sync
    # loop across processes: `sparrow bench rollout --processes 2` (its CPU twin in test_docs).
    runs = cases + [{**cases[0], "name": "again"}] if role == "rollout" else cases[:1]
    for case in runs:
        start = time.perf_counter()
        cfg = RolloutConfig(**{**case["cfg"],
                               "stop_token_ids": tuple(case["cfg"]["stop_token_ids"])})
        traj = generate(model, tokens, lengths, cfg=cfg, budgets=np.asarray(case["budgets"]),
                        bin_size=case["bin_size"], group_size=case["group_size"],
                        rng=jax.random.key(case["seed"]), spec=spec)
        rows = {k: multihost.local_rows(getattr(traj, k))
                for k in ("tokens", "logprobs", "budgets", "response_lengths", "mask")}
        np.savez(root / f"{case['name']}_{pid}.npz", **rows)
        st = continuous.LAST_STATS
        (root / f"{case['name']}_{pid}.json").write_text(json.dumps(
            {"global_rows": int(traj.tokens.shape[0]), "chunks": st.chunks,
             "prefills": st.prefills, "preemptions": st.preemptions, "pools": st.pools,
             "overlapped_chunks": st.overlapped_chunks,
             "host_ms_per_chunk": st.host_ms_per_chunk,
             "sync_ms_per_chunk": 1e3 * st.sync_seconds / max(st.chunks, 1),
             "guard_ms_per_chunk": 1e3 * st.guard_seconds / max(st.chunks, 1),
             "seconds": time.perf_counter() - start}))
    if role == "rollout":
        _time_coordination(root, pid, spec, slots=8, steps=8, topk=cfg.record_topk)
        # A peer that never makes an exchange (process 1 skips this one): the others raise
        # PeerTimeout naming it, instead of waiting forever.
        if pid == 0:
            try:
                multihost.host_allgather("skipped_by_1", b"x", timeout_s=1)
                (root / "peer_timeout.txt").write_text("no error")
            except multihost.PeerTimeout as e:
                (root / "peer_timeout.txt").write_text(str(e))


def _time_coordination(root: Path, pid: int, spec, *, slots: int, steps: int, topk: int,
                       repeats: int = 30) -> None:
    """The two cross-process steps of a decode chunk, back to back in lock step (no program or
    host-work skew between the processes in the figure): the digest check of the chunk's slot
    arrays and the replicated readback of its records."""
    from sparrow_jax.rollout import paged_multihost
    from sparrow_jax.runtime import multihost
    sync = paged_multihost.Coordination(spec)
    table = np.zeros((slots, 8), np.int32)
    rec = tuple(multihost.host_to_global(np.zeros(shape, dtype), spec.sharding(
        ("batch",) + (None,) * (len(shape) - 1), shape)) for shape, dtype in (
        ((slots, steps), np.int32), ((slots, steps), np.float32), ((slots, steps), np.int32),
        ((slots, steps, topk), np.float32), ((slots, steps, topk), np.int32),
        ((slots, steps), bool)))
    for _ in range(3):                  # compile and warm up
        sync.add(table)
        sync.check("decode", 0)
        sync.read_back(rec)
    sync.check_seconds = sync.read_seconds = 0.0
    for i in range(repeats):
        sync.add(table)
        sync.check("decode", i)
        sync.read_back(rec)
    (root / f"coordination_{pid}.json").write_text(json.dumps(
        {"digest_check_ms": 1e3 * sync.check_seconds / repeats,
         "readback_ms": 1e3 * sync.read_seconds / repeats, "slots": slots, "steps": steps,
         "record_topk": topk}))


# If the processes ever deadlock, print every thread's stack and exit (the test shows the log).
HANG_SECONDS = 540

if __name__ == "__main__":
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    role, root, pid, nproc, port = sys.argv[1:6]
    main(role, Path(root), int(pid), int(nproc), int(port))
