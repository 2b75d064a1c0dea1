"""Training: the `sparrow train` RL loop and the `sparrow sft` warm-up.

  config.py         TrainConfig (gin), gin_value, ConfigError
  preflight.py      every check that needs no model, before anything loads
  trainer.py        Trainer: builds the stages, checkpoints and resumes, evaluates, runs the loop
  step.py           one RL step: rollout -> rewards -> learner -> tail -> controller
  schedule_step.py  the controller's per-step evidence and metrics
  compile_plan.py   the programs a run compiles, logged at start-up
  command.py        `sparrow train`: checks, distributed start-up, run lock, Trainer.run
  host_check.py     `python -m sparrow_jax.train.host_check`: a pod host sees the run's paths
  sft.py            `sparrow sft`: supervised warm-up of the synthetic demo model

The package hands on the names users import (`from sparrow_jax.train import Trainer, train`),
loading their modules on first use.
"""

import importlib

_NAMES = {"TrainConfig": "config", "ConfigError": "config", "gin_value": "config",
          "Trainer": "trainer", "train": "command", "main": "command"}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
