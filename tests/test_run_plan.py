"""The run plan (sparrow_jax/train/plan.py): every derived setting in one place, the same plan for
the trainer, the compile plan and `sparrow dryrun`, and one rollout mode."""

from __future__ import annotations

import dataclasses
import re

import gin
import pytest

from hf_fixtures import gin_argv, make_tiny_run, make_tiny_synthetic_model, tiny_train_bindings
from sparrow_jax import cli
from sparrow_jax.evaluation.reference import ReferenceEvalConfig
from sparrow_jax.rl.distill import DistillConfig
from sparrow_jax.rl.grpo import LossConfig
from sparrow_jax.rl.learner import LearnerConfig
from sparrow_jax.rollout.config import RolloutConfig, RolloutMode
from sparrow_jax.sparsity.controller import ControllerConfig
from sparrow_jax.sparsity.schedule import DENSE_BUDGET, Schedule
from sparrow_jax.train import plan as run_plan
from sparrow_jax.train.config import ConfigError, TrainConfig

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def _train(**kw) -> TrainConfig:
    return TrainConfig(model_path="m", train_data="d", **kw)


def _resolve(train=None, rollout=None, schedule=None, learner=None, controller=None,
             distill=None, loss=None, **kw):
    return run_plan.resolve(train or _train(), rollout or RolloutConfig(), learner or LearnerConfig(),
                            loss or LossConfig(), schedule or Schedule((512, 1024) + (2048,) * 18),
                            controller or ControllerConfig(), distill or DistillConfig(),
                            ReferenceEvalConfig(), **kw)


# -- what the plan derives ---------------------------------------------------------------------
def test_sparse_plan_narrows_the_width_and_fits_the_controller():
    p = _resolve(rollout=RolloutConfig(max_budget=8192),
                 controller=ControllerConfig(max_budget=16384))
    assert p.mode == RolloutMode.SPARSE and p.adapts and p.probes
    # The controller's finite rungs end at the width the user set; the width then covers them.
    assert p.controller.max_budget == 8192 and p.rollout.max_budget == 8192
    assert p.controller.quantile == p.train.tail_quantile
    assert p.replay.max_selected == 8192 // 16 and p.eval_modes == ("dense", "sparse")
    assert p.rollout.record_topk == 0           # alpha "full" never reads the top-k record
    assert any("capped at the selection width" in n for n in p.notes)
    # Without the controller, the width is the schedule's largest budget.
    fixed = _resolve(train=_train(adapt_schedule=False), rollout=RolloutConfig(max_budget=8192))
    assert fixed.rollout.max_budget == 2048 and not fixed.adapts and not fixed.probes


def test_a_budget_over_the_width_is_refused():
    with pytest.raises(ValueError, match="schedule budgets reach 2048 tokens but RolloutConfig."
                                         "max_budget = 1024"):
        _resolve(rollout=RolloutConfig(max_budget=1024))


def test_dense_and_exact_plans_measure_no_mismatch():
    dense = _resolve(train=_train(rollout_mode="dense"))
    assert dense.mode == "dense" and dense.learner.alpha_mode == "none" and not dense.adapts
    assert dense.rollout.max_budget == RolloutConfig().max_budget   # nothing sparse to size
    exact = _resolve(train=_train(rollout_mode="exact_sparse"))
    assert exact.learner.alpha_mode == "none" and not exact.adapts and not exact.probes
    assert exact.rollout.max_budget == 2048 and exact.eval_modes == ("dense", "exact_sparse")
    assert any("controller does not run" in n for n in exact.notes)
    all_dense = _resolve(train=_train(rollout_mode="exact_sparse"),
                         schedule=Schedule((DENSE_BUDGET,) * 20))
    assert any("drafts attend densely" in w for w in all_dense.warnings)


def test_distill_needs_a_sparse_actor():
    assert _resolve(distill=DistillConfig(rank=4)).distills
    p = _resolve(train=_train(rollout_mode="dense"), distill=DistillConfig(rank=4))
    assert not p.distills and any("DistillConfig.rank = 4 ignored" in w for w in p.warnings)


def test_gamma_by_bin_that_cannot_apply_is_refused():
    plan = (2, 0, 2)
    with pytest.raises(ConfigError, match="gamma_by_bin .* exact_sparse rollouts, but the mode "
                                          "is 'sparse'"):
        _resolve(rollout=RolloutConfig(gamma=2, gamma_by_bin=plan))
    with pytest.raises(ConfigError, match="has 21 entries but the schedule has 20 length bins"):
        _resolve(train=_train(rollout_mode="exact_sparse"),
                 rollout=RolloutConfig(mode="exact_sparse", gamma=2, gamma_by_bin=(2,) * 21))
    ok = _resolve(train=_train(rollout_mode="exact_sparse"),
                  rollout=RolloutConfig(mode="exact_sparse", gamma=2, gamma_by_bin=plan))
    assert ok.rollout.gamma_by_bin == plan


def test_a_kl_coefficient_without_a_reference_policy_is_refused():
    """LossConfig.kl_coef weighs a KL to a reference policy that `sparrow train` never
    computes: a non-zero value was silently ignored; now it is refused by name."""
    with pytest.raises(ConfigError, match=r"LossConfig.kl_coef = 0.01 has no effect"):
        _resolve(loss=LossConfig(kl_coef=0.01))
    assert _resolve(loss=LossConfig(kl_coef=0.0))


def test_approximate_bins_that_cannot_apply_are_refused():
    """`approximate_from_bin` (a plan across modes) is refused outside exact_sparse, and past the
    schedule's last bin (no bin would decode approximately: a setting silently ignored)."""
    with pytest.raises(ConfigError, match="approximate_from_bin = 3 is part of a plan for "
                                          "exact_sparse rollouts, but the mode is 'sparse'"):
        _resolve(rollout=RolloutConfig(approximate_from_bin=3))
    with pytest.raises(ConfigError, match="approximate_from_bin = 20 but the schedule has 20 "
                                          "length bins"):
        _resolve(train=_train(rollout_mode="exact_sparse"),
                 rollout=RolloutConfig(mode="exact_sparse", gamma=2, approximate_from_bin=20))
    ok = _resolve(train=_train(rollout_mode="exact_sparse"),
                  rollout=RolloutConfig(mode="exact_sparse", gamma=2, approximate_from_bin=3))
    assert any("length bins 3+ decode approximately sparse" in n for n in ok.notes)


# -- one mode, one quantile --------------------------------------------------------------------
def test_run_mode_is_one_setting():
    assert run_plan.run_mode("sparse", "exact_sparse", train_bound=False,
                             rollout_bound=True) == "exact_sparse"
    assert run_plan.run_mode("dense", "sparse", train_bound=True, rollout_bound=False) == "dense"
    assert run_plan.run_mode("dense", "dense", train_bound=True, rollout_bound=True) == "dense"
    with pytest.raises(ConfigError) as e:
        run_plan.run_mode("sparse", "exact_sparse", train_bound=True, rollout_bound=True)
    assert str(e.value) == ("rollout mode: TrainConfig.rollout_mode = 'sparse' and RolloutConfig."
                            "mode = 'exact_sparse' disagree: they are one setting (the run's "
                            "rollout mode); bind one of them")
    p = _resolve(rollout=RolloutConfig(mode="exact_sparse"), train_mode_bound=False,
                 rollout_mode_bound=True)
    assert p.mode == p.train.rollout_mode == "exact_sparse"


def test_controller_quantile_is_the_trainers():
    with pytest.raises(ConfigError, match="ControllerConfig.quantile = 0.1 and TrainConfig."
                                          "tail_quantile = 0.05 disagree"):
        _resolve(controller=ControllerConfig(quantile=0.1), quantile_bound=True)


def test_a_wrong_mode_fails_at_config_time_naming_the_choices():
    with pytest.raises(ValueError, match=r"RolloutConfig.mode must be one of \('sparse', "
                                         r"'dense', 'compress', 'exact_sparse'\), got 'sprase'"):
        RolloutConfig(mode="sprase")
    with pytest.raises(ValueError, match="TrainConfig.rollout_mode must be one of"):
        _train(rollout_mode="exact")
    with pytest.raises(ValueError, match="RolloutConfig.engine must be one of"):
        RolloutConfig(engine="page")
    # A binding that is not even a string is named before anything is built
    # (runtime.config_check); a wrong string, by the config with the run's other problems.
    from sparrow_jax.runtime import config_check
    gin.clear_config()
    try:
        gin.parse_config("RolloutConfig.mode = 3")
        with pytest.raises(TypeError, match=r"RolloutConfig.mode = 3: expected one of "
                                            r"\('sparse', 'dense', 'compress', 'exact_sparse'\)"):
            config_check.check_bindings()
        gin.clear_config()
        gin.parse_config("RolloutConfig.mode = 'sprase'")
        config_check.check_bindings()
    finally:
        gin.clear_config()


# -- the trainer, the compile plan and the dryrun read one plan --------------------------------
def _training_configs() -> list[str]:
    """Every shipped config that configures a `sparrow train` run (not arms, sft, calibration)."""
    return sorted(p.name for p in (REPO / "configs").glob("*.gin")
                  if re.search(r"^TrainConfig\.", p.read_text(), re.M)
                  and not p.name.startswith(("experiment_", "sft_", "calibrate_")))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = make_tiny_run(tmp_path_factory.mktemp("plan"), eval_rows=0)
    # The real configs format prompts with the model's chat template.
    make_tiny_synthetic_model(root / "chat_model", chat_template=(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    return root


@pytest.mark.parametrize("config", _training_configs())
def test_trainer_compile_plan_and_dryrun_share_the_plan(tiny, tmp_path, config):
    """Each shipped config at its own settings (only the model, data, run directory and reward
    workers swapped for tiny local ones): the plan the trainer builds is the plan gin resolves,
    and the dryrun and compile plan read the same one."""
    from sparrow_jax.dryrun.programs import step_shape
    from sparrow_jax.dryrun.targets import get_target
    from sparrow_jax.train import compile_plan
    from sparrow_jax.train.trainer import Trainer

    swaps = {"TrainConfig.model_path": repr(str(tiny / "chat_model")),
             "TrainConfig.train_data": repr(str(tiny / "train.jsonl")),
             "TrainConfig.eval_data": "''", "TrainConfig.run_dir": repr(str(tmp_path / "run")),
             "TrainConfig.reward_processes": "0", "TrainConfig.mesh_model": "1",
             "ReferenceEvalConfig.data": "None"}
    gin.clear_config()
    try:
        cli.parse_gin([str(REPO / "configs" / config)], [f"{k} = {v}" for k, v in swaps.items()])
        expected = run_plan.from_gin()
        trainer = Trainer(TrainConfig())
        try:
            assert trainer.plan == expected
            assert trainer.rollout_cfg == dataclasses.replace(
                expected.rollout, stop_token_ids=trainer.rollout_cfg.stop_token_ids,
                pad_token_id=trainer.rollout_cfg.pad_token_id)
            shape = step_shape(trainer.model.config, get_target("h100x8"))
            assert shape.plan == expected
            assert (shape.rollout, shape.learner, shape.replay) == (
                expected.rollout, expected.learner, expected.replay)
            assert compile_plan.for_trainer(trainer) == compile_plan.for_run(
                expected, trainer.model.config, compile_plan.trainer_shape(trainer))
        finally:
            trainer.close()
    finally:
        gin.clear_config()


def test_a_shipped_config_plan_is_what_it_says():
    """configs/qwen3_1p7b_gpu.gin: sparse under the controller, the width at the config's 8192."""
    gin.clear_config()
    try:
        cli.parse_gin([str(REPO / "configs" / "qwen3_1p7b_gpu.gin")], [])
        p = run_plan.from_gin()
    finally:
        gin.clear_config()
    assert p.mode == "sparse" and p.adapts and p.rollout.max_budget == 8192
    assert p.rollout.engine == "paged" and p.controller.quantile == 0.05


# -- the mode conflict from the command line ---------------------------------------------------
def test_train_refuses_two_modes_in_one_line(tiny, capsys):
    binds = tiny_train_bindings(tiny, "conflict", 1, TrainConfig__rollout_mode="'sparse'")
    gin.clear_config()
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *gin_argv(binds, ["RolloutConfig.mode = 'exact_sparse'"])])
    message = str(e.value)
    assert message.startswith("sparrow train: ") and "\n" not in message
    assert "TrainConfig.rollout_mode = 'sparse' and RolloutConfig.mode = 'exact_sparse'" in message
    assert not (tiny / "conflict").exists()          # refused before anything was written


def test_rollout_config_mode_alone_runs_that_mode(tiny, capsys):
    """`--gin_param 'RolloutConfig.mode = "exact_sparse"'` with no trainer mode bound: the run is
    exact sparse (its metrics carry the exact-sparse checks)."""
    from sparrow_jax.runtime.metrics import read_jsonl
    binds = tiny_train_bindings(tiny, "exact", 1, RolloutConfig__gamma="2")
    gin.clear_config()
    assert cli.main(["train", *gin_argv(binds, ["RolloutConfig.mode = 'exact_sparse'"])]) == 0
    rows = read_jsonl(tiny / "exact")
    assert "exact/tokens_per_pass" in rows[-1] and "controller/lowered" not in rows[-1]
