"""`sparrow train` with fault injection, for tests/test_faults.py (run as a subprocess).

    python tests/fault_worker.py train --gin_param ...    (same arguments as `sparrow`)

The environment variable SPARROW_FAULTS (JSON) says what to inject:
  trace:        file to which the phases of the run are appended as they start
                ("rollout 3", "reward 3", "learner 3", "checkpoint 3", "saved 3", "batch 3 <ids>"),
                so the test can SIGKILL the process inside a chosen phase;
  nan_steps:    RL steps (1-based) whose advantages are NaN (a non-finite loss and gradient);
  enospc_step:  the checkpoint write of this step fails with OSError(ENOSPC) half-way (after
                the arrays, before the config item);
  slow_save_s:  extra seconds inside every checkpoint write (a wider window for a kill there);
  slow_reward_s: extra seconds per scored completion (the same for reward scoring);
  worker_start_error: this module raises ImportError(<text>) when a reward worker imports it.

Also defines reward functions the tests name as "fault_worker:<name>".
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time

TRACE = None
# Read here too: spawned reward workers import this module without running main().
SLOW_REWARD_S = float(json.loads(os.environ.get("SPARROW_FAULTS") or "{}")
                      .get("slow_reward_s", 0))


def _trace(line: str) -> None:
    if TRACE:
        with open(TRACE, "a") as f:
            f.write(line + "\n")
            f.flush()


def varied(completion_text: str, ground_truth: str, *, prompt: str = "", meta=None) -> float:
    """A deterministic reward that varies with the completion (a random tiny model never earns
    the real task's reward, so its updates would all be zero)."""
    time.sleep(SLOW_REWARD_S)
    return float(len(completion_text.split()) % 3) / 2


def hostile(completion_text: str, ground_truth: str, *, prompt: str = "", meta=None):
    """Raises, or returns a string, None or NaN, for three completions in four."""
    kind = len(completion_text) % 4
    if kind == 0:
        raise RuntimeError("reward function bug")
    return ["1", None, float("nan"), 0.5][kind]


def wrong_signature(completion_text: str, ground_truth: str) -> float:
    """Takes no prompt/meta keywords: the pool's call fails on every completion."""
    return 1.0


# Imported as "fault_worker" (the reward names below resolve so); not as __main__, nor as a
# spawned reward worker's __mp_main__ (which then imports "fault_worker" to unpickle the reward).
if __name__ == "fault_worker":
    # worker_start_error: the reward module fails to import in the reward workers only (as a
    # module whose dependency the workers' environment lacks).
    _START_ERROR = json.loads(os.environ.get("SPARROW_FAULTS") or "{}").get("worker_start_error")
    import multiprocessing
    if _START_ERROR and multiprocessing.parent_process() is not None:
        raise ImportError(_START_ERROR)
    from sparrow_jax.rewards.registry import register_reward
    register_reward("varied")(varied)
    register_reward("hostile")(hostile)
    register_reward("wrong_signature")(wrong_signature)


def _install(faults: dict) -> None:
    global TRACE
    import numpy as np

    from sparrow_jax.train import trainer as train
    from sparrow_jax.runtime import checkpoint, metrics
    from sparrow_jax.rl.learner import Learner

    TRACE = faults.get("trace")
    current = {"step": 0}

    original_call = metrics.StepTimer.__call__

    def traced_call(self, name):
        _trace(f"{name} {current['step']}")
        return original_call(self, name)
    metrics.StepTimer.__call__ = traced_call

    original_rl_step = train.Trainer.rl_step

    def rl_step(self, timer):
        current["step"] = self.step + 1
        return original_rl_step(self, timer)
    train.Trainer.rl_step = rl_step

    original_next = train.make_prompt_iterator

    def make_iterator(*args, **kwargs):
        it = original_next(*args, **kwargs)
        cls = type(it)
        plain_next = cls.__next__

        def traced_next(self):
            batch = plain_next(self)
            _trace(f"batch {current['step']} {json.dumps(batch.ids)}")
            return batch
        cls.__next__ = traced_next
        return it
    train.make_prompt_iterator = make_iterator

    nan_steps = set(faults.get("nan_steps", ()))
    original_adv = Learner.advantages

    def advantages(self, rewards):
        adv = original_adv(self, rewards)
        return adv * np.float32("nan") if current["step"] in nan_steps else adv
    Learner.advantages = advantages

    original_save = train.Trainer.save

    def save(self, force=False):
        _trace(f"checkpoint {self.step}")
        original_save(self, force)
        _trace(f"saved {self.step}")
    train.Trainer.save = save

    enospc_step = faults.get("enospc_step")
    slow = float(faults.get("slow_save_s", 0))
    original_text_save = checkpoint.TextHandler.save

    def text_save(self, directory, args):
        if slow:
            time.sleep(slow)
        if enospc_step is not None and f"{os.sep}{enospc_step}." in os.fspath(directory):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(directory))
        return original_text_save(self, directory, args)
    checkpoint.TextHandler.save = text_save


def main(argv: list[str]) -> int:
    # As a user's install (torch is a test-only dependency, pyproject's `test` extra): without
    # it transformers loads the tokenizer without importing torch, ~1.4 CPU-s per run here.
    # sparrow_jax never imports torch; a module that did would fail here with ImportError.
    sys.modules.setdefault("torch", None)
    import fault_worker  # registers the rewards under the importable name
    faults = json.loads(os.environ.get("SPARROW_FAULTS", "{}"))
    fault_worker.SLOW_REWARD_S = float(faults.get("slow_reward_s", 0))
    _install(faults)
    from sparrow_jax import cli
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
