"""One process of a local multi-process JAX run (launched by tests/test_multihost.py).

    python tests/multihost_worker.py generate ROOT PROCESS_ID NUM_PROCESSES PORT
    python tests/multihost_worker.py train ROOT PROCESS_ID NUM_PROCESSES PORT [gin params...]

Each process has 4 CPU devices (XLA_FLAGS set by the launcher) and joins the others through
jax.distributed on localhost, exactly as hosts of a pod slice do.
"""

import faulthandler
import json
import sys
from pathlib import Path

import numpy as np


def generate(root: Path, pid: int, nproc: int, port: int) -> None:
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid)
    from sparrow_jax.runtime import multihost
    from sparrow_jax.model import load_hf
    from hf_fixtures import process_prompts
    from sparrow_jax.rollout import RolloutConfig, generate as run
    from sparrow_jax.runtime.sharding import ShardingSpec, make_mesh

    spec = ShardingSpec.create(make_mesh(model=2))
    model = load_hf(root / "model", mesh=spec.mesh)
    # This process's prompts only; its prompts are ragged and narrower than the other's.
    tokens, lengths = process_prompts(root, pid, nproc)
    cfg = RolloutConfig(max_new_tokens=24, max_budget=48, temperature=1.0, backend="xla",
                        stop_token_ids=())
    traj = run(model, tokens, lengths, cfg=cfg, budgets=np.full(20, 48), bin_size=16,
               group_size=2, rng=jax.random.key(7), spec=spec)
    out = {k: multihost.local_rows(getattr(traj, k)) for k in ("tokens", "logprobs", "budgets")}
    np.savez(root / f"rows_{pid}.npz", **out)
    everyone = multihost.all_rows(out["tokens"])
    (root / f"summary_{pid}.json").write_text(json.dumps(
        {"global_rows": int(traj.tokens.shape[0]), "all_rows": everyone.shape[0],
         "devices": jax.device_count(), "local_devices": jax.local_device_count()}))


def train(root: Path, pid: int, nproc: int, port: int, params: list[str]) -> None:
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from sparrow_jax import cli
    argv = ["train", *params,
            "--gin_param", "TrainConfig.distributed = True",
            "--gin_param", f"TrainConfig.coordinator_address = 'localhost:{port}'",
            "--gin_param", f"TrainConfig.num_processes = {nproc}",
            "--gin_param", f"TrainConfig.process_id = {pid}"]
    sys.exit(cli.main(argv))


# A worker normally finishes in about a minute. If the processes ever deadlock (e.g. in a
# cross-process collective), print every thread's stack to the log and exit, so the test fails
# with that diagnosis (in its message) instead of waiting out the launcher's timeout.
HANG_SECONDS = 600

if __name__ == "__main__":
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    role, root, pid, nproc, port = sys.argv[1:6]
    if role == "generate":
        generate(Path(root), int(pid), int(nproc), int(port))
    else:
        train(Path(root), int(pid), int(nproc), int(port), sys.argv[6:])
