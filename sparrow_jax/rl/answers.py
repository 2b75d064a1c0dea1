"""Final-answer extraction from a completion: the forms math prompts ask for.

  boxed        the last `\\boxed{...}` / `\\fbox{...}` (nested braces handled)
  answer_line  the last line of the form `Answer: ...` (DAPO-Math asks "The last line of your
               response should be of the form Answer: $Answer"); also `Final Answer:`,
               `**Answer:**`; a box on that line gives the box's content

`extract_answer(text, formats)` returns the answer of whichever form appears *last* in the text
(the model's final word), so a prompt asking for one form and a model writing the other (Qwen3
habitually boxes) both score. The reward names choose the forms (`sparrow_jax.rl.rewards`):
`math_verify` = both, `math_verify_boxed`, `math_verify_answer_line`.
"""

from __future__ import annotations

import re
from typing import Sequence

ANSWER_FORMATS = ("boxed", "answer_line")

_ANSWER_LINE = re.compile(
    r"^[ \t>#*_]*(?:final[ \t]+)?answer[ \t*_]*[:\uff1a][ \t*_]*(?P<answer>.*?)[ \t]*$",
    re.IGNORECASE | re.MULTILINE)


def extract_last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, nested braces included.

    Also accepts the brace-less form `\\boxed 5`. Returns None when there is no box or the last
    one is unterminated (a truncated generation has no answer; we do not fall back to an earlier
    box, which might be a scratch value).
    """
    start = _last_box_start(text)
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if i < len(text) and text[i] == " ":
        # "\boxed 5": the answer is the next whitespace/`$`-delimited token.
        rest = text[i:].lstrip(" ")
        token = rest.split("$", 1)[0].split()
        return token[0] if token else None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    j = i
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2  # an escaped character (e.g. `\{`) never opens or closes the box
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None


def _last_box_start(text: str) -> int:
    return max(text.rfind("\\boxed"), text.rfind("\\fbox"))


def _last_answer_line(text: str) -> tuple[int, str | None]:
    """(start of the last `Answer:` line or -1, its answer or None when empty)."""
    match = None
    for match in _ANSWER_LINE.finditer(text):
        pass
    if match is None:
        return -1, None
    value = match.group("answer").strip()
    if _last_box_start(value) >= 0:
        return match.start(), extract_last_boxed(value)
    value = value.strip("*_ ").rstrip(".").strip()
    if len(value) >= 2 and value.startswith("$") and value.endswith("$"):
        value = value.strip("$").strip()
    return match.start(), value or None


def extract_answer(text: str, formats: Sequence[str] = ANSWER_FORMATS) -> str | None:
    """The final answer in `text` by the last-appearing of `formats`, or None."""
    unknown = set(formats) - set(ANSWER_FORMATS)
    if unknown or not formats:
        raise ValueError(f"answer formats must be a non-empty subset of {ANSWER_FORMATS}, "
                         f"got {tuple(formats)}")
    found: list[tuple[int, str | None]] = []
    if "boxed" in formats:
        start = _last_box_start(text)
        if start >= 0:
            found.append((start, extract_last_boxed(text)))
    if "answer_line" in formats:
        start, value = _last_answer_line(text)
        if start >= 0:
            found.append((start, value))
    if not found:
        return None
    # An `Answer: \boxed{5}` line: both forms start on that line and agree.
    return max(found, key=lambda x: x[0])[1]
