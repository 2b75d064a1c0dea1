"""Prompt loading (JSONL/Parquet, chat templates, malformed rows) and the grain iterator."""

from __future__ import annotations

import json

import gin
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparrow_jax.data import synthetic
from sparrow_jax.data.prompts import (
    PromptDataset,
    PromptFormat,
    PromptIterator,
    load_prompt_records,
    make_prompt_iterator,
)
from sparrow_jax.data.tokenizer import build_synthetic_tokenizer, build_word_level_tokenizer

WORDS = "what is one plus two three four five six seven eight nine ten be brief q".split()
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tok():
    return build_word_level_tokenizer(
        WORDS + ["<user>", "<assistant>", "<system>"], chat_template=TEMPLATE
    )


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def numbered_rows(n):
    return [
        {"id": f"q{i}", "prompt": f"what is {WORDS[i % 10]}", "answer": str(i)} for i in range(n)
    ]


def test_jsonl_fields_and_malformed_rows(tmp_path, chat_tok):
    rows = [
        {"prompt": "what is one", "answer": "1", "id": "a", "source": "x"},
        {"prompt": "what is two", "ground_truth": 2},
        '{"prompt": "what is three", "answer": ',  # row 3: bad JSON
        {"prompt": "what is four"},  # row 4: no answer
        {"prompt": ["what"], "answer": "5"},  # row 5: wrong type
        "",  # blank line: ignored, not a row
        {"messages": [{"role": "user"}], "answer": "7"},  # row 7: malformed message
        "[1, 2]",  # row 8: not an object
        {"prompt": "what is nine", "solution": "9"},
        {"prompt": "what is ten", "answer": ["10"]},  # row 10: answer of wrong type
    ]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    records, report = load_prompt_records(path, chat_tok)
    assert [r["answer"] for r in records] == ["1", "2", "9"]
    assert records[0]["id"] == "a" and records[0]["meta"] == {"source": "x"}
    assert records[1]["id"] == "p.jsonl:2"
    assert [row for _, row, _ in report.skipped] == [3, 4, 5, 7, 8, 10]
    assert report.rows == 9 and report.loaded == 3 and "6 malformed" in report.summary()
    assert "bad JSON" in report.skipped[0][2] and "missing answer" in report.skipped[1][2]
    ids = records[0]["prompt_ids"]
    assert ids.dtype == np.int32 and ids[0] == chat_tok.bos_token_id  # plain text: <bos> added
    assert chat_tok.decode(ids, skip_special_tokens=True) == "what is one"
    with pytest.raises(ValueError, match=r"p\.jsonl: row 3: bad JSON"):
        load_prompt_records(path, chat_tok, on_error="raise")
    with pytest.raises(ValueError, match="no usable prompts"):
        load_prompt_records(write_jsonl(tmp_path / "bad.jsonl", ['{"x": 1}']), chat_tok)


def test_parquet_messages_and_chat_template(tmp_path, chat_tok):
    table = pa.table(
        {
            "messages": [[{"role": "user", "content": "what is two plus two"}], None],
            "prompt": [None, "what is one"],
            "answer": ["4", "1"],
        }
    )
    path = str(tmp_path / "p.parquet")
    pq.write_table(table, path)
    records, _ = load_prompt_records(path, chat_tok)
    assert records[0]["prompt"] == "<user> what is two plus two <assistant>"
    assert chat_tok.decode(records[0]["prompt_ids"]) == records[0]["prompt"]  # no extra <bos>
    assert records[1]["prompt"] == "what is one"
    fmt = PromptFormat(use_chat_template=True, system_prompt="be brief")
    records, _ = load_prompt_records(path, chat_tok, fmt=fmt)
    assert records[1]["prompt"] == "<system> be brief <user> what is one <assistant>"
    assert chat_tok.unk_token_id not in records[1]["prompt_ids"]
    with pytest.raises(ValueError, match="chat_template"):
        load_prompt_records(path, build_word_level_tokenizer(WORDS))


def test_custom_fields_and_length_limit(tmp_path, chat_tok):
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"question": "what is one", "gold": "1", "uid": 7},
            {"question": "what is one plus two plus three", "gold": "6", "uid": 8},
        ],
    )
    fmt = PromptFormat(prompt_field="question", answer_fields=("gold",), id_field="uid")
    records, report = load_prompt_records(path, chat_tok, fmt=fmt, max_prompt_len=5)
    assert [r["id"] for r in records] == ["7"] and report.too_long == ((path, 2, 8),)
    with pytest.raises(ValueError, match="row 2: prompt has 8 > 5"):
        load_prompt_records(path, chat_tok, fmt=fmt, max_prompt_len=5, on_too_long="raise")


def ids_of(it, steps):
    return [list(b.ids) for b in (next(it) for _ in range(steps))]


def test_shuffle_epochs_and_padding(tmp_path, chat_tok):
    path = write_jsonl(tmp_path / "n.jsonl", numbered_rows(12))
    it = make_prompt_iterator(path, chat_tok, batch_size=4, seed=1, num_epochs=2, pad_multiple=8)
    batches = list(it)
    assert len(batches) == 6 == 2 * it.steps_per_epoch
    b = batches[0]
    assert b.prompt_ids.shape == (4, 8) and b.prompt_ids.dtype == np.int32
    np.testing.assert_array_equal(b.prompt_lengths, [4, 4, 4, 4])  # <bos> what is N
    assert np.all(b.prompt_ids[:, 4:] == chat_tok.pad_token_id)  # right padding
    assert [int(a) for a in b.answers] == [int(i[1:]) for i in b.ids]
    epoch1 = sum((list(x.ids) for x in batches[:3]), [])
    epoch2 = sum((list(x.ids) for x in batches[3:]), [])
    assert sorted(epoch1) == sorted(epoch2) == sorted(f"q{i}" for i in range(12))
    assert epoch1 != epoch2 and epoch1 != [f"q{i}" for i in range(12)]  # reshuffled each epoch
    again = make_prompt_iterator(path, chat_tok, batch_size=4, seed=1, num_epochs=2)
    assert [x.ids for x in again] == [x.ids for x in batches]
    other = make_prompt_iterator(path, chat_tok, batch_size=4, seed=2, num_epochs=2)
    assert [x.ids for x in other] != [x.ids for x in batches]
    ordered = make_prompt_iterator(
        path,
        chat_tok,
        batch_size=5,
        shuffle=False,
        num_epochs=1,
        drop_remainder=False,
        max_prompt_len=6,
        pad_to_max=True,
    )
    last = list(ordered)[-1]
    assert last.ids == ("q10", "q11") and last.prompt_ids.shape == (2, 6)


def test_sharding(tmp_path, chat_tok):
    ds = PromptDataset.from_files(write_jsonl(tmp_path / "s.jsonl", numbered_rows(11)), chat_tok)
    shards = [
        ds.iterator(batch_size=5, seed=3, num_epochs=1, shard_index=i, shard_count=2)
        for i in range(2)
    ]
    seen = [set(sum(ids_of(it, 1), [])) for it in shards]
    assert len(seen[0]) == len(seen[1]) == 5 and not seen[0] & seen[1]  # equal, disjoint
    default = ds.iterator(batch_size=2, seed=3)  # defaults: jax.process_index()/count() = 0/1
    assert default.get_state()["shard_count"] == 1 and default.num_records == 11
    with pytest.raises(ValueError, match="shard"):
        ds.iterator(batch_size=1, shard_index=2, shard_count=2)


def test_state_restore_continues_same_order(tmp_path, chat_tok):
    path = write_jsonl(tmp_path / "r.jsonl", numbered_rows(10))
    it = make_prompt_iterator(path, chat_tok, batch_size=3, seed=5)  # forever, crosses epochs
    ids_of(it, 4)
    saved = json.dumps(it.get_state())  # what the train loop writes with its checkpoint
    expected = ids_of(it, 6)
    resumed = make_prompt_iterator(path, chat_tok, batch_size=3, seed=5)
    resumed.set_state(json.loads(saved))
    assert ids_of(resumed, 6) == expected
    with pytest.raises(ValueError, match="does not match"):
        make_prompt_iterator(path, chat_tok, batch_size=3, seed=6).set_state(json.loads(saved))


def test_synthetic_rows_through_pipeline_and_gin(tmp_path):
    path = str(tmp_path / "syn.jsonl")
    synthetic.write_jsonl(path, 8, seed=0, k_range=(2, 2), num_letters=26)
    tok = build_synthetic_tokenizer()
    gin.clear_config()
    gin.parse_config("make_prompt_iterator.batch_size = 4\nmake_prompt_iterator.seed = 9")
    it = make_prompt_iterator(path, tok)
    gin.clear_config()
    assert isinstance(it, PromptIterator)
    b = next(it)
    assert b.prompt_ids.shape == (4, 64) and np.all(b.prompt_lengths == 57)
    assert np.all(b.prompt_ids[:, 0] == tok.bos_token_id)
    assert all("solution" in m for m in b.metas)
    exact = synthetic.synthetic_exact_reward
    assert all(
        exact(m["solution"], a, prompt=p) == 1.0
        for m, a, p in zip(b.metas, b.answers, b.prompts, strict=True)
    )


def test_repeated_prompts_in_a_batch_are_announced(tmp_path, chat_tok, caplog):
    """Issue #45 list 7: prompts_per_step above the data's rows repeated prompts in every
    batch without a word."""
    path = write_jsonl(tmp_path / "n.jsonl", numbered_rows(3))
    with caplog.at_level("WARNING"):
        it = make_prompt_iterator(path, chat_tok, batch_size=6, seed=0)
    assert "the batch of 6 prompts (TrainConfig.prompts_per_step) is larger than the 3" in (
        caplog.text) and "repeats prompts (about 2.0 times each)" in caplog.text
    ids = next(it).ids
    assert len(ids) == 6 and len(set(ids)) < 6          # what the warning says
    caplog.clear()
    with caplog.at_level("WARNING"):
        make_prompt_iterator(path, chat_tok, batch_size=3, seed=0)
    assert "repeats prompts" not in caplog.text
