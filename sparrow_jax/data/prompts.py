"""Prompt sets for RL: local JSONL/Parquet files -> tokenized records -> a grain iterator.

Row layouts (plain, chat, verl/DAPO, OpenR1) and data paths (files, directories, globs, lists):
`sparrow_jax.data.rows`. The ground truth is the first present field of `answer_fields`
("answer", "ground_truth", "solution", "reward_model.ground_truth"); numbers become strings.
Other fields (e.g. `data_source`, `extra_info`) are kept as `meta` and passed to the reward.

Chat rows (a `messages` list, or a list in `prompt`) are rendered with the tokenizer's
`apply_chat_template(..., add_generation_prompt=True)`; plain prompts too when
`PromptFormat.use_chat_template = True` (the real configs set it: Qwen3's chat/thinking format).
Rendered text is tokenized without adding special tokens (the template has them); plain text
with them (e.g. <bos>). `PromptFormat` is gin-configurable, so training and evaluation data
render alike.

The iterator is grain's `DatasetIterator` (shuffle with a seed, reshuffled each epoch, per-host
shard, optional epoch count) wrapped so that `get_state()` is a JSON-serialisable dict the train
loop stores with its checkpoint; `set_state()` on a freshly built iterator continues the exact
same batch order.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Sequence

import gin
import grain
import numpy as np

from sparrow_jax.data import rows as _rows
from sparrow_jax.data.rows import RowError, expand_paths

logger = logging.getLogger(__name__)

ANSWER_FIELDS = ("answer", "ground_truth", "solution", "reward_model.ground_truth")
_REASONS_SHOWN = 3  # skip reasons named in the one-line summary; every one is logged at DEBUG


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What happened while loading: rows read, records kept, and (file, row, reason) of drops.

    Row numbers are 1-based line numbers for JSONL and 1-based row indices for Parquet.
    """

    rows: int
    loaded: int
    skipped: tuple[tuple[str, int, str], ...]
    too_long: tuple[tuple[str, int, int], ...]  # (file, row, prompt length)

    def summary(self) -> str:
        reasons = "; ".join(f"{os.path.basename(f)}:{r}: {why}"
                            for f, r, why in self.skipped[:_REASONS_SHOWN])
        more = len(self.skipped) - _REASONS_SHOWN
        if more > 0:
            reasons += f"; {more} more (every row at --log_level DEBUG)"
        return (
            f"{self.loaded}/{self.rows} prompts loaded; {len(self.skipped)} malformed rows skipped"
            f"{f' ({reasons})' if reasons else ''}; {len(self.too_long)} too long dropped"
        )


@gin.configurable
@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How rows become token ids (see module docstring). gin: `PromptFormat.use_chat_template`."""

    prompt_field: str = "prompt"
    messages_field: str = "messages"
    answer_fields: tuple[str, ...] = ANSWER_FIELDS
    id_field: str = "id"
    use_chat_template: bool = False
    system_prompt: str | None = None
    add_special_tokens: bool | None = None  # None: True for plain text, False for templated


def _render(row: dict, fmt: PromptFormat, tokenizer: Any) -> tuple[str, bool]:
    """(text to tokenize, whether it came from the chat template)."""
    if row.get(fmt.messages_field) is not None:
        messages = _rows.messages(row[fmt.messages_field], fmt.messages_field)
    else:
        prompt = row.get(fmt.prompt_field)
        if prompt is None:
            raise RowError(f"missing {fmt.prompt_field!r} or {fmt.messages_field!r}")
        if isinstance(prompt, list):  # verl/DAPO: the prompt is a chat list
            messages = _rows.messages(prompt, fmt.prompt_field)
        elif not isinstance(prompt, str) or not prompt:
            raise RowError(f"{fmt.prompt_field!r} must be a non-empty string or list of messages")
        elif not fmt.use_chat_template:
            return prompt, False
        else:
            messages = [{"role": "user", "content": prompt}]
    if fmt.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": fmt.system_prompt}, *messages]
    if not getattr(tokenizer, "chat_template", None):
        # A configuration error, not a bad row: never skipped silently.
        raise ValueError(
            "chat rows or PromptFormat.use_chat_template=True need a tokenizer with a chat_template"
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text, True


def load_prompt_records(
    paths: str | Sequence[str],
    tokenizer: Any,
    *,
    fmt: PromptFormat | None = None,
    max_prompt_len: int | None = None,
    on_error: str = "skip",
    on_too_long: str = "drop",
) -> tuple[list[dict[str, Any]], LoadReport]:
    """Read, validate, render and tokenize every row.

    Returns records {id, prompt (the exact tokenized text), answer, answer_field, prompt_ids
    (int32 [P]), meta} and a LoadReport. fmt None = `PromptFormat()` (its gin bindings).
    on_error: "skip" (count + log) or "raise" (ValueError naming file and row); on_too_long
    ("drop" or "raise") applies to prompts longer than max_prompt_len.
    """
    if on_error not in ("skip", "raise") or on_too_long not in ("drop", "raise"):
        raise ValueError(f"bad policy: on_error={on_error!r}, on_too_long={on_too_long!r}")
    fmt = PromptFormat() if fmt is None else fmt
    records: list[dict[str, Any]] = []
    skipped: list[tuple[str, int, str]] = []
    too_long: list[tuple[str, int, int]] = []
    rows = 0
    for path in expand_paths(paths):
        for row_no, row in _rows.iter_rows(path):
            rows += 1
            try:
                if isinstance(row, Exception):
                    raise row
                if not isinstance(row, dict):
                    raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
                answer_field, answer = _rows.answer(row, fmt.answer_fields)
                text, templated = _render(row, fmt, tokenizer)
            except RowError as e:
                if on_error == "raise":
                    raise ValueError(f"{path}: row {row_no}: {e}") from None
                logger.debug("prompt data: %s: row %d skipped: %s", path, row_no, e)
                skipped.append((path, row_no, str(e)))
                continue
            add_special = (
                (not templated) if fmt.add_special_tokens is None else fmt.add_special_tokens
            )
            ids = np.asarray(tokenizer.encode(text, add_special_tokens=add_special), np.int32)
            if max_prompt_len is not None and len(ids) > max_prompt_len:
                if on_too_long == "raise":
                    raise ValueError(
                        f"{path}: row {row_no}: prompt has {len(ids)} > {max_prompt_len} tokens"
                    )
                logger.debug("prompt data: %s: row %d dropped: %d > %d tokens", path, row_no,
                             len(ids), max_prompt_len)
                too_long.append((path, row_no, len(ids)))
                continue
            # The nested answer's parent (reward_model) stays in meta: it may carry more.
            used = {fmt.prompt_field, fmt.messages_field, fmt.id_field, answer_field}
            records.append(
                {
                    "id": str(row.get(fmt.id_field, f"{os.path.basename(path)}:{row_no}")),
                    "prompt": text,
                    "answer": answer,
                    "answer_field": answer_field,
                    "prompt_ids": ids,
                    "meta": {k: v for k, v in row.items() if k not in used},
                }
            )
    report = LoadReport(rows, len(records), tuple(skipped), tuple(too_long))
    if skipped or too_long:
        logger.warning("prompt data: %s", report.summary())
    if not records:
        raise ValueError(f"no usable prompts in {paths}: {report.summary()}")
    return records, report


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """A batch of prompts as the rollout takes them (`PromptIterator`, held-out and eval batches).

    prompt_ids [B, P] int32, right-padded with the pad id; prompt_lengths [B] int32; answers,
    prompts, ids, metas: one per row (the ground truth, the prompt text, the row's id, the other
    fields passed to the reward); valid [B] bool: the real rows - False marks copies that pad a
    batch to a row count the data axis divides, which no metric counts."""
    prompt_ids: np.ndarray
    prompt_lengths: np.ndarray
    answers: tuple[str, ...]
    prompts: tuple[str, ...]
    ids: tuple[Any, ...]
    metas: tuple[dict[str, Any] | None, ...]
    valid: np.ndarray

    @classmethod
    def from_records(cls, records: Sequence[dict[str, Any]], pad_id: int, *,
                     rows: int | None = None, filler: dict[str, Any] | None = None,
                     width: int | None = None, multiple: int = 1) -> "PromptBatch":
        """Tokenized prompt records (`PromptDataset.records`) as one batch, padded to `rows`
        rows with copies of `filler` (default: the first record - a real prompt, so padded rows
        prefill and decode like any other; `valid` marks them) and to `width` tokens (default:
        the longest prompt rounded up to `multiple`)."""
        rows = len(records) if rows is None else rows
        if rows < len(records):
            raise ValueError(f"rows={rows} is fewer than the {len(records)} records")
        filler = filler if filler is not None else (records[0] if records else None)
        if rows > len(records) and filler is None:
            raise ValueError("padding an empty record list needs a filler record")
        padded = list(records) + [filler] * (rows - len(records))
        if not padded:
            raise ValueError("PromptBatch.from_records: no records")
        lengths = np.asarray([len(r["prompt_ids"]) for r in padded], np.int32)
        width = width or -(-int(lengths.max()) // multiple) * multiple
        ids = np.full((rows, width), pad_id, np.int32)
        for i, r in enumerate(padded):
            ids[i, :lengths[i]] = r["prompt_ids"]
        return cls(prompt_ids=ids, prompt_lengths=lengths,
                   answers=tuple(r["answer"] for r in padded),
                   prompts=tuple(r["prompt"] for r in padded),
                   ids=tuple(r.get("id") for r in padded),
                   metas=tuple(r.get("meta") for r in padded),
                   valid=np.arange(rows) < len(records))

    def __len__(self) -> int:
        return int(self.prompt_lengths.shape[0])

    def rows(self, start: int, stop: int) -> "PromptBatch":
        """Rows start .. stop - 1 (a rollout call's sub-batch)."""
        return PromptBatch(*(x[start:stop] for x in dataclasses.astuple(self)))

    def padded_to(self, rows: int) -> "PromptBatch":
        """This batch with copies of its last row appended up to `rows` rows (marked not
        `valid`): a short final batch keeps the compiled program's batch shape."""
        extra = rows - len(self)
        if extra < 0:
            raise ValueError(f"padded_to({rows}): the batch has {len(self)} rows already")

        def pad(x):
            if isinstance(x, np.ndarray):
                return np.concatenate([x, np.repeat(x[-1:], extra, axis=0)])
            return tuple(x) + (x[-1],) * extra
        out = PromptBatch(*(pad(x) for x in dataclasses.astuple(self)))
        return dataclasses.replace(out, valid=np.concatenate([self.valid, np.zeros(extra, bool)]))

    def per_sample(self, samples: int) -> "PromptBatch":
        """Each row repeated `samples` times in place (rows g*n .. g*n+n-1 are prompt g's), as
        a rollout of `samples` samples per prompt lays out its rows."""
        def rep(x):
            return np.repeat(x, samples, axis=0) if isinstance(x, np.ndarray) else tuple(
                v for v in x for _ in range(samples))
        return PromptBatch(*(rep(x) for x in dataclasses.astuple(self)))


class PromptIterator:
    """Batches of prompts from a grain pipeline: source -> shard -> shuffle -> repeat -> batch.

    Each batch is a `PromptBatch`; its width P is the batch's longest prompt rounded up to
    `pad_multiple` (few distinct shapes -> few recompiles), or max_prompt_len when `pad_to` is
    set to it.
    """

    def __init__(self, records: Sequence[dict[str, Any]], *, batch_size: int, seed: int = 0,
                 shuffle: bool = True, num_epochs: int | None = None,
                 shard_index: int | None = None, shard_count: int | None = None,
                 drop_remainder: bool = True, pad_id: int = 0, pad_multiple: int = 16,
                 pad_to: int | None = None):
        if shard_index is None or shard_count is None:
            import jax  # only for the defaults: one shard per host

            shard_index = jax.process_index() if shard_index is None else shard_index
            shard_count = jax.process_count() if shard_count is None else shard_count
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"bad shard {shard_index} of {shard_count}")
        # Equal shard sizes keep every host on the same number of steps (lock-step training).
        per_shard = len(records) // shard_count
        if per_shard == 0:
            raise ValueError(f"{len(records)} prompts cannot be split over {shard_count} shards")
        shard = list(records[shard_index : per_shard * shard_count : shard_count])
        if drop_remainder and num_epochs is not None and batch_size > per_shard * num_epochs:
            raise ValueError(
                f"batch_size {batch_size} > {per_shard} x {num_epochs} epochs of prompts"
            )
        self.batch_size, self.pad_id, self.pad_multiple, self.pad_to = (
            batch_size,
            pad_id,
            pad_multiple,
            pad_to,
        )
        self.num_records = per_shard
        if batch_size > per_shard:
            # Each batch then holds some prompts twice or more: their groups count double in
            # the step's advantages and gradient (issue #45: this happened without a word).
            logger.warning(
                "the batch of %d prompts (TrainConfig.prompts_per_step) is larger than the %d "
                "prompts of the data%s: every batch repeats prompts (about %.1f times each). "
                "Use more prompts or a smaller prompts_per_step", batch_size, per_shard,
                f" (this process's shard of {shard_count})" if shard_count > 1 else "",
                batch_size / per_shard)
        self.first_record = shard[0]  # logged at the start of training (what the model sees)
        self._fingerprint = {
            "num_records": per_shard,
            "seed": seed,
            "shuffle": shuffle,
            "num_epochs": num_epochs,
            "shard_index": shard_index,
            "shard_count": shard_count,
            "batch_size": batch_size,
        }
        ds = grain.MapDataset.source(shard)
        if shuffle:
            ds = ds.shuffle(seed=seed)
        # repeat reseeds the shuffle each epoch; None = forever.
        ds = ds.repeat(num_epochs).batch(
            batch_size, drop_remainder=drop_remainder, batch_fn=self._collate
        )
        # No threads or prefetch: deterministic, and no absl flag parsing needed.
        self._it = iter(
            ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_records // self.batch_size

    def _collate(self, rows: Sequence[dict[str, Any]]) -> PromptBatch:
        return PromptBatch.from_records(rows, self.pad_id, width=self.pad_to,
                                        multiple=self.pad_multiple)

    def __iter__(self) -> "PromptIterator":
        return self

    def __next__(self) -> PromptBatch:
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable position (grain state + the settings it is only valid for)."""
        return {"grain": self._it.get_state(), **self._fingerprint}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from `get_state()`; raises if the data or settings differ (the saved
        position would then silently mean a different order)."""
        diff = {k: (state.get(k), v) for k, v in self._fingerprint.items() if state.get(k) != v}
        if diff:
            raise ValueError(
                f"data iterator state does not match this pipeline (saved, now): {diff}"
            )
        self._it.set_state(state["grain"])


class PromptDataset:
    """Loaded, tokenized prompt records plus their LoadReport; `.iterator(...)` batches them."""

    def __init__(self, records: list[dict[str, Any]], report: LoadReport, pad_id: int):
        self.records, self.report, self.pad_id = records, report, pad_id

    @classmethod
    def from_files(
        cls, paths: str | Sequence[str], tokenizer: Any, **load_kwargs: Any
    ) -> "PromptDataset":
        """Load with `load_prompt_records(paths, tokenizer, **load_kwargs)`."""
        records, report = load_prompt_records(paths, tokenizer, **load_kwargs)
        pad_id = tokenizer.pad_token_id
        if pad_id is None:
            pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        return cls(records, report, int(pad_id))

    def __len__(self) -> int:
        return len(self.records)

    def iterator(self, *, batch_size: int, **kwargs: Any) -> PromptIterator:
        return PromptIterator(self.records, batch_size=batch_size, pad_id=self.pad_id, **kwargs)


@gin.configurable
def make_prompt_iterator(path: str | Sequence[str], tokenizer: Any, *, batch_size: int,
                         seed: int = 0, shuffle: bool = True, num_epochs: int | None = None,
                         shard_index: int | None = None, shard_count: int | None = None,
                         drop_remainder: bool = True, max_prompt_len: int | None = None,
                         pad_to_max: bool = False, pad_multiple: int = 16,
                         on_error: str = "skip", on_too_long: str = "drop",
                         prompt_field: str | None = None, messages_field: str | None = None,
                         answer_fields: Sequence[str] | None = None, id_field: str | None = None,
                         use_chat_template: bool | None = None,
                         system_prompt: str | None = None) -> PromptIterator:
    """Load `path` (file, directory, glob or list) and return a checkpointable batch iterator.

    batch_size = prompts per step on this host; shard_index/shard_count default to
    jax.process_index()/process_count(); num_epochs=None repeats forever. The format arguments
    override `PromptFormat`'s (gin) values where given; evaluation data uses `PromptFormat`.
    """
    given = dict(prompt_field=prompt_field, messages_field=messages_field,
                 answer_fields=None if answer_fields is None else tuple(answer_fields),
                 id_field=id_field, use_chat_template=use_chat_template,
                 system_prompt=system_prompt)
    fmt = PromptFormat(**{k: v for k, v in given.items() if v is not None})
    if pad_to_max and max_prompt_len is None:
        raise ValueError("pad_to_max needs max_prompt_len")
    dataset = PromptDataset.from_files(path, tokenizer, fmt=fmt, max_prompt_len=max_prompt_len,
                                       on_error=on_error, on_too_long=on_too_long)
    return dataset.iterator(batch_size=batch_size, seed=seed, shuffle=shuffle,
                            num_epochs=num_epochs, shard_index=shard_index,
                            shard_count=shard_count, drop_remainder=drop_remainder,
                            pad_multiple=pad_multiple,
                            pad_to=max_prompt_len if pad_to_max else None)
