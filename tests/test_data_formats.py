"""Real RL data sets as users bring them (#29, #28): verl/DAPO/OpenR1 rows, the chat template
from gin, answers in the form the prompt asks for, skip reasons, BOM, undecodable bytes, data
directories / globs / lists, and `sparrow data check`."""

from __future__ import annotations

import json
import logging
import os

import gin
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparrow_jax.data.prompts import PromptDataset, PromptFormat, load_prompt_records
from sparrow_jax.data.rows import expand_paths
from sparrow_jax.data.tokenizer import build_word_level_tokenizer
from sparrow_jax.rewards.answers import extract_answer
from sparrow_jax.rewards.registry import get_reward

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("what is one plus two three solve x find the answer last line form Answer: be brief "
         "reasoning $Answer").split()
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
DAPO_PROMPT = ("solve x find the answer last line form Answer: $Answer")


@pytest.fixture(scope="module")
def tok():
    return build_word_level_tokenizer(WORDS + ["<user>", "<assistant>", "<system>"],
                                      chat_template=TEMPLATE)


def write_jsonl(path, rows, *, prefix: bytes = b"") -> str:
    data = b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)
    path.write_bytes(prefix + data)
    return str(path)


def verl_table(n: int = 3) -> pa.Table:
    """The verl/DAPO parquet layout: a chat list in `prompt`, the answer in
    `reward_model.ground_truth`, plus data_source / extra_info / ability."""
    return pa.table({
        "data_source": ["math_dapo"] * n,
        "prompt": [[{"role": "user", "content": DAPO_PROMPT}] for _ in range(n)],
        "ability": ["MATH"] * n,
        "reward_model": [{"ground_truth": str(34 + i), "style": "rule-lighteval/MATH_v2"}
                         for i in range(n)],
        "extra_info": [{"index": f"idx-{i}", "split": "train"} for i in range(n)],
    })


def test_verl_parquet_loads_with_chat_template_and_scores_its_ground_truth(tmp_path, tok):
    path = str(tmp_path / "dapo.parquet")
    pq.write_table(verl_table(), path)
    records, report = load_prompt_records(path, tok)
    assert report.loaded == 3 and not report.skipped
    r = records[0]
    assert r["prompt"] == f"<user> {DAPO_PROMPT} <assistant>"
    assert tok.decode(r["prompt_ids"]) == r["prompt"]         # template output, no extra <bos>
    assert r["answer"] == "34" and r["answer_field"] == "reward_model.ground_truth"
    assert r["meta"]["data_source"] == "math_dapo"
    assert r["meta"]["extra_info"] == {"index": "idx-0", "split": "train"}
    reward = get_reward("math_verify")
    # The DAPO prompt asks for an `Answer:` line; Qwen3 often boxes: both forms score.
    for completion in ("thinking ...\nAnswer: 34", "so \\boxed{34}", "Answer: $34$",
                       "**Final Answer:** \\boxed{34}"):
        assert reward(completion, r["answer"]) == 1.0, completion
    assert reward("Answer: 35", r["answer"]) == 0.0
    assert get_reward("math_verify_boxed")("Answer: 34", "34") == 0.0      # configurable
    assert get_reward("math_verify_answer_line")("\\boxed{34}", "34") == 0.0


def test_openr1_rows_drop_the_reference_solution(tmp_path, tok):
    """OpenR1 stores the whole conversation in `messages`: the assistant's solution is not
    part of the prompt."""
    row = {"problem": "find x", "answer": "2", "messages": [
        {"role": "user", "content": "find x"}, {"role": "assistant", "content": "x is 2"}]}
    bad = {"answer": "2", "messages": [{"role": "assistant", "content": "x is 2"}]}
    records, report = load_prompt_records(write_jsonl(tmp_path / "r1.jsonl", [row, bad]), tok)
    assert records[0]["prompt"] == "<user> find x <assistant>"
    assert [why for _, _, why in report.skipped] == ["'messages' has only assistant messages: "
                                                     "no prompt left"]


@pytest.mark.parametrize("text,forms,expected", [
    ("Answer: 12", ("boxed", "answer_line"), "12"),
    ("Answer: 3\nlater \\boxed{4}", ("boxed", "answer_line"), "4"),      # the last one wins
    ("\\boxed{4}\nAnswer: 3", ("boxed", "answer_line"), "3"),
    ("\\boxed{4}\nAnswer: 3", ("boxed",), "4"),
    ("the answer is 3", ("boxed", "answer_line"), None),
    ("> **Answer**: 1/2.", ("answer_line",), "1/2"),
    ("Answer:", ("answer_line",), None),
])
def test_extract_answer(text, forms, expected):
    assert extract_answer(text, forms) == expected


def test_prompt_format_from_gin_applies_to_every_loader(tmp_path, tok):
    """The real configs bind PromptFormat.use_chat_template; evaluation data (loaded without
    an explicit format) renders the same way as training data."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "what is one", "answer": "1"}])
    gin.clear_config()
    try:
        gin.parse_config("PromptFormat.use_chat_template = True")
        assert PromptDataset.from_files(path, tok).records[0]["prompt"] == \
            "<user> what is one <assistant>"
    finally:
        gin.clear_config()
    assert PromptDataset.from_files(path, tok).records[0]["prompt"] == "what is one"


@pytest.mark.parametrize("config", ["qwen3_1p7b_gpu.gin", "qwen3_8b_tpu.gin",
                                    "qwen3_0p6b_v5e.gin"])
def test_real_configs_use_the_chat_template(config):
    from sparrow_jax import cli
    gin.clear_config()
    try:
        cli.parse_gin([os.path.join(REPO, "configs", config)], [])
        assert PromptFormat().use_chat_template
        assert gin.query_parameter("TrainConfig.reward") == "math_verify"
    finally:
        gin.clear_config()


def test_skip_reasons_bom_and_undecodable_bytes(tmp_path, tok, caplog):
    rows = [b'{"prompt": "what is one", "answer": "1"}',
            b'{"prompt": "what is two \xff\xfe", "answer": "2"}',      # line 2: not UTF-8
            b'{"prompt": "what is three"}',                            # line 3: no answer
            b'{"prompt": "what is two", "answer": ',                   # line 4: bad JSON
            b'{"prompt": 5, "answer": "5"}',                           # line 5: wrong type
            b'{"prompt": "one plus two", "answer": "3"}']
    path = write_jsonl(tmp_path / "bom.jsonl", rows, prefix=b"\xef\xbb\xbf")
    with caplog.at_level(logging.DEBUG, logger="sparrow_jax.data.prompts"):
        records, report = load_prompt_records(path, tok)
    assert [r["answer"] for r in records] == ["1", "3"]      # the BOM did not cost row 1
    assert [row for _, row, _ in report.skipped] == [2, 3, 4, 5]
    assert report.skipped[0][2] == "not UTF-8: byte 0xff at column 25"
    summary = report.summary()
    # The first few reasons are in the one-line summary, the rest at DEBUG.
    assert "bom.jsonl:2: not UTF-8" in summary and "bom.jsonl:3: missing answer" in summary
    assert "1 more (every row at --log_level DEBUG)" in summary
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("row 5 skipped" in m and "non-empty string" in m for m in debug), debug
    with pytest.raises(ValueError, match=r"bom\.jsonl: row 2: not UTF-8"):
        load_prompt_records(path, tok, on_error="raise")
    with pytest.raises(ValueError, match=r"no usable prompts .*x\.jsonl:1: missing answer"):
        load_prompt_records(write_jsonl(tmp_path / "x.jsonl", [{"prompt": "one"}]), tok)


def test_directories_globs_and_lists(tmp_path, tok):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    (d / ".cache").mkdir()
    a = write_jsonl(d / "a.jsonl", [{"prompt": "one", "answer": "1"}])
    pq.write_table(verl_table(2), str(d / "sub" / "b.parquet"))
    write_jsonl(d / ".cache" / "c.jsonl", [{"prompt": "two", "answer": "2"}])   # hidden: skipped
    (d / "README.md").write_text("not data")
    assert expand_paths(str(d)) == [a, str(d / "sub" / "b.parquet")]
    assert expand_paths(str(d / "**" / "*.parquet")) == [str(d / "sub" / "b.parquet")]
    assert expand_paths([a, str(d / "sub")]) == [a, str(d / "sub" / "b.parquet")]
    assert len(load_prompt_records([str(d)], tok)[0]) == 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no"):
        expand_paths(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="matches no file"):
        expand_paths(str(d / "*.txt"))
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        expand_paths([a, str(d / "missing.jsonl")])


def test_first_prompt_is_described_for_the_start_of_training(tok, caplog):
    from sparrow_jax.data import check

    record = {"id": "q1", "prompt": f"<user> {DAPO_PROMPT} <assistant>", "prompt_ids": [1, 2],
              "answer": "\\frac{1}{2}", "answer_field": "reward_model.ground_truth"}
    with caplog.at_level(logging.INFO, logger="sparrow_jax.data.check"):
        check.log_first_prompt(record, "math_verify")
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "first prompt (q1, 2 tokens) as the model sees it: '<user> solve x" in text
    assert len(caplog.records) == 3           # one line each: the console stays line-per-record
    assert "its answer (reward_model.ground_truth): '\\\\frac{1}{2}'; math-verify reads it as" in text
    assert "\\boxed{...}: 1, Answer: ...: 1" in text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # A boxed-only reward on a prompt that asks for an Answer: line would train on ~0 reward.
    _, problems = check.describe_first_prompt(record, "math_verify_boxed")
    assert problems and "asks for an 'Answer:' line" in problems[0]


# ---------------------------------------------------------------------- sparrow data check

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hf_fixtures import make_tiny_synthetic_model
    return str(make_tiny_synthetic_model(tmp_path_factory.mktemp("m") / "model",
                                         chat_template=TEMPLATE))




def _data_check(argv, capsys):
    from sparrow_jax import cli
    gin.clear_config()
    try:
        rc = cli.main(["data", "check", *argv])
    except SystemExit as e:
        rc = e.code
    finally:
        gin.clear_config()
    return rc, capsys.readouterr().out


def test_data_check_good_and_bad_files(tmp_path, model_dir, capsys, restore_logging):
    good = str(tmp_path / "dapo.parquet")
    pq.write_table(verl_table(), good)
    config = os.path.join(REPO, "configs", "qwen3_1p7b_gpu.gin")
    rc, out = _data_check([good, config, "--model", model_dir], capsys)
    assert rc == 0, out
    assert "rows: 3; loaded: 3; skipped (malformed): 0" in out
    assert "first prompt (dapo.parquet:1," in out and "<user> solve x" in out
    assert "its answer (reward_model.ground_truth): '34'" in out
    assert "\\boxed{...}: 1, Answer: ...: 1" in out and out.rstrip().endswith("PASS")
    assert "answers math-verify parses: 3 of the first 3" in out
    # Some bad rows: listed with file, line and reason; the rest is usable (exit 0).
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "one", "answer": "1"},
                                                   b"\xff", {"prompt": "two"}])
    rc, out = _data_check([mixed, "--model", model_dir], capsys)
    assert rc == 0, out
    assert f"skipped {mixed}:2: not UTF-8" in out and f"skipped {mixed}:3: missing answer" in out
    # Nothing usable, or a reward that cannot score the answers: exit 1 with the reason.
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "one", "gold": "1"}])
    rc, out = _data_check([bad, "--model", model_dir], capsys)
    assert rc == 1 and "no usable prompts" in out and out.rstrip().endswith("FAIL"), out
    rc, out = _data_check([good, "--model", model_dir, "--reward", "math_verify_boxed"], capsys)
    assert rc == 1 and "asks for an 'Answer:' line" in out, out
    rc, out = _data_check([str(tmp_path / "nope.jsonl"), "--model", model_dir], capsys)
    assert rc == 1 and "prompt file not found" in out


def test_train_config_takes_a_list_of_data_paths(tmp_path, tok):
    """docs/data.md: a data path may be a list; gin's type check and TrainConfig accept one."""
    from sparrow_jax.runtime import config_check
    from sparrow_jax.train.config import TrainConfig

    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "one", "answer": "1"}])
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"prompt": "two", "answer": "2"}])
    gin.clear_config()
    try:
        gin.parse_config(f"TrainConfig.train_data = ['{a}', '{tmp_path / 'd'}']\n"
                         "TrainConfig.model_path = '/m'")
        config_check.check_bindings()
        paths = TrainConfig().train_data
    finally:
        gin.clear_config()
    assert [r["answer"] for r in load_prompt_records(paths, tok)[0]] == ["1", "2"]
