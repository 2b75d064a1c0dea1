"""Small word-level Hugging Face tokenizers, built locally (nothing is downloaded).

Text convention: one symbol per token, symbols separated by single spaces. Encoding splits on
whitespace; decoding joins tokens with single spaces, so `decode(encode(s)) == s` for any
canonical (single-space separated, no leading/trailing space) text over the vocabulary.

The tokenizer is a `transformers.PreTrainedTokenizerFast`, so it round-trips through
`save_pretrained(dir)` / `AutoTokenizer.from_pretrained(dir)` like any real checkpoint's
tokenizer, and the rest of the code never special-cases it.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING, Sequence

import gin
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# transformers is imported inside the functions: it pulls in torch (~4 s), and the constants
# below are needed by reward worker processes that must start fast.

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3: pad = 0 so zero-initialised buffers are padding

# The synthetic task's vocabulary (see data/synthetic.py): table/prompt markers, digits, letters.
SYNTHETIC_MARKERS = ("|", ">", "=")
SYNTHETIC_SYMBOLS = SYNTHETIC_MARKERS + tuple(string.digits) + tuple(string.ascii_lowercase)


def build_word_level_tokenizer(
    symbols: Sequence[str],
    *,
    add_bos: bool = True,
    chat_template: str | None = None,
    model_max_length: int = 1 << 20,
) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over `SPECIAL_TOKENS + symbols` (ids in that order).

    add_bos: encoding with `add_special_tokens=True` prepends `<bos>` (never appends `<eos>`:
    the model must generate it). Unknown words map to `<unk>`.
    """
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for sym in (*SPECIAL_TOKENS, *symbols):
        if not sym or any(c.isspace() for c in sym):
            raise ValueError(f"symbols must be non-empty and contain no whitespace: {sym!r}")
        vocab.setdefault(sym, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
        )
    # WordPiece's decoder with a prefix that never occurs is a plain " ".join; cleanup=False
    # keeps e.g. " ." intact so decoding is an exact inverse.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        padding_side="right",
    )
    if chat_template is not None:
        hf.chat_template = chat_template
    return hf


@gin.configurable
def build_synthetic_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer of the synthetic cyclic-lookup task: 4 specials + 3 markers + 10 digits +
    26 letters = 43 tokens (pad 0, bos 1, eos 2, unk 3)."""
    return build_word_level_tokenizer(SYNTHETIC_SYMBOLS)


def save_synthetic_tokenizer(directory: str) -> PreTrainedTokenizerFast:
    """Build the synthetic tokenizer and `save_pretrained` it into `directory`."""
    tok = build_synthetic_tokenizer()
    tok.save_pretrained(directory)
    return tok


@gin.configurable
def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained(path)` from a local directory only (never the Hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
