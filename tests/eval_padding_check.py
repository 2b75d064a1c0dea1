"""Held-out evaluation of 5 prompts on an 8-way data mesh (run by test_eval_padding.py).

XLA_FLAGS must be set before jax is imported, so this runs as its own process:
    python tests/eval_padding_check.py OUT_DIR
It builds a `Trainer` on 8 host CPU devices with 5 eval prompts (which the 8-way data axis does
not divide), runs its evaluation, and prints one JSON line comparing it with the unsharded
evaluation of the same 5 prompts (no padding) for dense and sparse decoding.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402

from sparrow_jax import cli  # noqa: E402

from sparrow_jax.evaluation import heldout as evaluation
from sparrow_jax.data import synthetic  # noqa: E402
from sparrow_jax.data.prompts import PromptDataset  # noqa: E402
from sparrow_jax.model import load_hf  # noqa: E402
from sparrow_jax.rollout.api import generate_timed  # noqa: E402
from sparrow_jax.rewards import scoring  # noqa: E402
from sparrow_jax.rewards.pool import RewardPool  # noqa: E402
from sparrow_jax.rewards.registry import register_reward  # noqa: E402
from sparrow_jax.train import Trainer, TrainConfig  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(REPO, "checkpoints", "demo_sft")  # a trained model: prompt-dependent output


@register_reward("pad_check_chars")
def chars_reward(completion_text: str, ground_truth: str, *, prompt: str = "",
                 meta: dict | None = None) -> float:
    """A reward that differs between prompts, so that counting a padding row (a copy of the
    first prompt) would move the mean."""
    return float(sum(map(ord, completion_text)) % 13)


def main(out: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    synthetic.write_jsonl(os.path.join(out, "train.jsonl"), 8, seed=0)
    synthetic.write_jsonl(os.path.join(out, "eval.jsonl"), 12, seed=1)
    cli.parse_gin([], [
        f"TrainConfig.run_dir = '{os.path.join(out, 'run')}'",
        f"TrainConfig.model_path = '{MODEL}'",
        f"TrainConfig.train_data = '{os.path.join(out, 'train.jsonl')}'",
        f"TrainConfig.eval_data = '{os.path.join(out, 'eval.jsonl')}'",
        "TrainConfig.eval_prompts = 5",
        "TrainConfig.reward = 'pad_check_chars'",
        "TrainConfig.reward_processes = 0",
        "TrainConfig.prompts_per_step = 4",
        "TrainConfig.group_size = 2",
        "TrainConfig.dtype = 'float32'",
        "RolloutConfig.max_new_tokens = 48",
        "RolloutConfig.max_budget = 64",
        "RolloutConfig.backend = 'xla'",
        f"make_schedule.budgets = {[48] * 20}",
        "make_schedule.bin_size = 16",
        "ControllerConfig.min_budget = 48",
        "ControllerConfig.max_budget = 64",
        "LearnerConfig.micro_batch_size = 8",
    ])
    trainer = Trainer(TrainConfig())
    batch = trainer.eval_batch
    sharded = trainer.evaluate()
    row = {"mesh": {k: int(v) for k, v in trainer.spec.mesh.shape.items()},
           "rows": int(batch["prompt_ids"].shape[0]), "valid": int(np.sum(batch["valid"]))}

    # The same 5 prompts on one device, unpadded, with the trainer's settings and rng.
    model = load_hf(MODEL, dtype=np.float32)
    records = PromptDataset.from_files(os.path.join(out, "eval.jsonl"),
                                       trainer.tokenizer).records[:5]
    plain = evaluation.batch_records(records, trainer.tokenizer.pad_token_id)
    pool = RewardPool("pad_check_chars", processes=0)
    sched = trainer.controller.schedule
    for mode in ("dense", "sparse"):
        rc = dataclasses.replace(trainer.rollout_cfg, mode=mode,
                                 temperature=trainer.cfg.eval_temperature)
        ref = evaluation.evaluate(model, trainer.tokenizer, pool, plain, cfg=rc,
                                  budgets=np.asarray(sched.budgets), bin_size=sched.bin_size,
                                  rng=jax.random.key(trainer.cfg.seed + 1))
        # What the mean would be if the padding rows (copies of prompt 0) were counted.
        traj, _ = generate_timed(model, plain["prompt_ids"], plain["prompt_lengths"], cfg=rc,
                                 budgets=np.asarray(sched.budgets), bin_size=sched.bin_size,
                                 group_size=1, rng=jax.random.key(trainer.cfg.seed + 1))
        texts = scoring.decode_responses(trainer.tokenizer, traj)
        per_row = [chars_reward(t, "") for t in texts]
        with_padding = float(np.mean(per_row + [per_row[0]] * (row["rows"] - len(per_row))))
        row[mode] = {"sharded_reward": sharded[f"eval_{mode}/reward"], "reward": ref["reward"],
                     "sharded_length": sharded[f"eval_{mode}/response_length"],
                     "length": ref["response_length"], "reward_if_padding_counted": with_padding}
    trainer.close()
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
