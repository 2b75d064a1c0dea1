"""A resume continues the same run (issue #45, list 1-2): `check_resume` against saved runs.

Quick tests over a hand-made run directory (the files a checkpoint step holds: its operative
config and JSON extra; no arrays are read). The user-level subprocess case is in
tests/test_run_safety.py (test_changed_setting_on_resume_is_refused_before_the_model_loads).
"""

from __future__ import annotations

import json
from pathlib import Path

import gin
import pytest

from sparrow_jax.runtime.faults import RunError
from sparrow_jax.train import resume_config
from sparrow_jax.train import trainer  # noqa: F401  (registers every configurable)

SAVED = """
TrainConfig.model_path = '{root}/model'
TrainConfig.train_data = '{root}/train.jsonl'
TrainConfig.param_dtype = 'float32'
TrainConfig.total_steps = 4
TrainConfig.eval_every = 2
TrainConfig.run_dir = '{root}/run'
TrainConfig.reward_processes = 4
LearnerConfig.learning_rate = 0.001
make_schedule.budgets = [48, 48]
"""


def _run_dir(root: Path, step: int = 3, sha: str | None = "a" * 64) -> Path:
    step_dir = root / "run" / "checkpoints" / str(step)
    (step_dir / "operative_config").mkdir(parents=True)
    (step_dir / "extra").mkdir()
    (step_dir / "operative_config" / "operative_config.gin").write_text(SAVED.format(root=root))
    (step_dir / "extra" / "metadata").write_text(json.dumps({resume_config.DATA_KEY: sha}))
    return root / "run"


def _check(root: Path, *bindings: str, total: int = 4, overrides=(), sha="a" * 64):
    gin.clear_config()
    gin.parse_config(SAVED.format(root=root).splitlines() + list(bindings))
    try:
        return resume_config.check_resume(root / "run", total, overrides, sha)
    finally:
        gin.clear_config()


def test_same_settings_resume_and_free_ones_may_change(tmp_path):
    _run_dir(tmp_path)
    plan = _check(tmp_path)
    assert plan == resume_config.ResumePlan(3, {})
    # Where the run executes may change; total_steps too, down to the run's step (recorded).
    plan = _check(tmp_path, "TrainConfig.reward_processes = 0",
                  "LearnerConfig.micro_batch_size = 1", "TrainConfig.total_steps = 9", total=9)
    assert plan.changes == {"TrainConfig.total_steps": (4, 9)}


def test_fresh_run_has_nothing_to_compare(tmp_path):
    assert _check(tmp_path, "TrainConfig.param_dtype = 'bfloat16'") is None


@pytest.mark.parametrize("binding, line", [
    ("TrainConfig.param_dtype = 'bfloat16'", "TrainConfig.param_dtype: 'float32' -> 'bfloat16'"),
    ("LearnerConfig.learning_rate = 1e-4", "LearnerConfig.learning_rate: 0.001 -> 0.0001"),
    ("make_schedule.budgets = [48, 48, 48]", "make_schedule.budgets: [48, 48] -> [48, 48, 48]"),
    # A setting the saved run left at its default, now bound: old is the default.
    ("LearnerConfig.warmup_steps = 3", "LearnerConfig.warmup_steps: 0 -> 3"),
    ("TrainConfig.group_size = 4", "TrainConfig.group_size: 8 -> 4"),
    # Once reported as the data iterator's "{'batch_size': (2, 4)}" after the model loaded.
    ("TrainConfig.prompts_per_step = 2", "TrainConfig.prompts_per_step: 4 -> 2"),
])
def test_a_setting_that_changes_training_is_refused_by_name(tmp_path, binding, line):
    _run_dir(tmp_path)
    with pytest.raises(RunError) as e:
        _check(tmp_path, binding)
    message = str(e.value)
    assert line in message and "nothing was moved or changed" in message
    assert "another TrainConfig.run_dir" in message
    assert str(tmp_path / "run" / "checkpoints" / "3" / "operative_config") in message


def test_new_model_path_and_data_content_are_refused(tmp_path):
    _run_dir(tmp_path)
    with pytest.raises(RunError, match=r"TrainConfig.model_path: '.*/model' -> '.*/other'"):
        _check(tmp_path, f"TrainConfig.model_path = '{tmp_path}/other'")
    # Same path, other bytes (a swapped file with the same row count).
    with pytest.raises(RunError, match="training data content"):
        _check(tmp_path, sha="b" * 64)


def test_cadence_changes_need_an_override_and_fixed_ones_cannot_have_one(tmp_path):
    _run_dir(tmp_path)
    with pytest.raises(RunError, match=r"eval_every: 2 -> 5  \(may change with "
                                       r"TrainConfig.resume_overrides = \['TrainConfig.eval_every'"):
        _check(tmp_path, "TrainConfig.eval_every = 5")
    plan = _check(tmp_path, "TrainConfig.eval_every = 5", overrides=("eval_every",))
    assert plan.changes == {"TrainConfig.eval_every": (2, 5)}
    with pytest.raises(RunError, match=r"resume_overrides names \['LearnerConfig.learning_rate'\]"):
        _check(tmp_path, overrides=("LearnerConfig.learning_rate",))
    # total_steps down to the run's step is the run's length; below it nothing would train.
    assert _check(tmp_path, "TrainConfig.total_steps = 3", total=3).changes == {
        "TrainConfig.total_steps": (4, 3)}
    with pytest.raises(RunError, match="total_steps = 2 but the run .* is at step 3"):
        _check(tmp_path, "TrainConfig.total_steps = 2", total=2)


def test_history_is_appended_not_rewritten(tmp_path):
    plan = resume_config.ResumePlan(3, {"TrainConfig.eval_every": (2, 5)})
    plan.record(tmp_path, 3)
    resume_config.ResumePlan(5, {"TrainConfig.total_steps": (4, 9)}).record(tmp_path, 5)
    lines = [json.loads(x) for x in (tmp_path / resume_config.HISTORY_FILE).read_text()
             .splitlines()]
    assert [x["step"] for x in lines] == [3, 5]
    assert lines[0]["changes"] == {"TrainConfig.eval_every": ["2", "5"]}


def test_data_fingerprint_sees_content_not_row_count(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"prompt": "1+1", "answer": "2"}\n')
    b.write_text('{"prompt": "1+2", "answer": "3"}\n')
    assert resume_config.data_fingerprint([str(a)]) != resume_config.data_fingerprint([str(b)])
    assert resume_config.data_fingerprint([str(a)]) == resume_config.data_fingerprint([str(a)])
