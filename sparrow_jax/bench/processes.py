"""`sparrow bench rollout --workload longtail --processes N`: the paged engine across N local JAX
processes, as the hosts of a pod slice run it (one scheduler on every process,
docs/rollout.md#several-hosts-one-scheduler-on-every-process), with and without the host loop
overlap, in one run.

The command re-launches itself N times on this machine's CPU (`JAX_PLATFORMS=cpu`,
`--devices_per_process` host devices each, jax.distributed over 127.0.0.1 with gloo
collectives); process p passes prompts [p * P / N, (p + 1) * P / N) and the mesh is
data = N x model = devices_per_process, one page pool per process. Process 0's output is the
benchmark's; the others' goes to a log that is printed if a process fails.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

# Set by `launch` in each child: "PROCESS_ID,NUM_PROCESSES,PORT,DEVICES_PER_PROCESS".
ENV = "SPARROW_BENCH_PROCESS"
# A dead peer is noticed within this many seconds (jax.distributed heartbeats).
HEARTBEAT_SECONDS = 30


def is_child() -> bool:
    return bool(os.environ.get(ENV))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: Sequence[str], processes: int, devices_per_process: int) -> int:
    """Runs this benchmark in `processes` local processes; process 0's output streams through.
    The exit status is the first non-zero one of the processes (0 if all succeed)."""
    port = _free_port()
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    print(f"# {processes} processes on this machine's CPU, {devices_per_process} device(s) each "
          f"(jax.distributed over 127.0.0.1:{port}, gloo collectives)", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="sparrow-bench-processes-"))
    procs = []
    for i in range(processes):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags),
               ENV: f"{i},{processes},{port},{devices_per_process}"}
        if i == 0:
            out = None
        else:
            with open(logs / f"process_{i}.log", "w") as log:
                out = os.dup(log.fileno())     # the child's copy; ours closes with the file
        procs.append(subprocess.Popen([sys.executable, "-m", "sparrow_jax.bench.rollout", *argv],
                                      env=env, stdout=out, stderr=subprocess.STDOUT))
        if out is not None:
            os.close(out)
    codes = [p.wait() for p in procs]
    if any(codes):
        for i in range(1, processes):
            text = (logs / f"process_{i}.log").read_text()
            print(f"--- process {i} (exit {codes[i]}):\n{text[-3000:]}", file=sys.stderr)
        return next(c for c in codes if c)
    return 0


def join():
    """In a child: joins the other processes (jax.distributed.initialize) and returns the
    ShardingSpec of the data = processes x model = devices_per_process mesh."""
    import jax
    from sparrow_jax.runtime.sharding import ShardingSpec, make_mesh
    pid, n, port, per = (int(x) for x in os.environ[ENV].split(","))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid,
                               heartbeat_timeout_seconds=HEARTBEAT_SECONDS)
    return ShardingSpec.create(make_mesh(model=per))


def my_prompts(tokens, lengths):
    """This process's block of the prompts (every process must get the same number)."""
    import jax
    n, p = jax.process_count(), jax.process_index()
    if len(tokens) % n:
        raise SystemExit(f"sparrow bench rollout: {len(tokens)} prompts do not split evenly "
                         f"over {n} processes (--samples / --group must be a multiple of it)")
    per = len(tokens) // n
    return tokens[p * per:(p + 1) * per], lengths[p * per:(p + 1) * per]
