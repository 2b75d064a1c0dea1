"""Final-answer extraction from a completion: the forms math prompts ask for.

  boxed        the last `\\boxed{...}` / `\\fbox{...}` (nested braces handled)
  answer_line  the last line of the form `Answer: ...` (DAPO-Math asks "The last line of your
               response should be of the form Answer: $Answer"); also `Final Answer:`,
               `**Answer:**`; a box on that line gives the box's content

`extract_answer(text, formats)` returns the answer of whichever form appears *last* in the text
(the model's final word), so a prompt asking for one form and a model writing the other (Qwen3
habitually boxes) both score. The reward names choose the forms
(`sparrow_jax.rewards.math_rewards`): `math_verify` = both, `math_verify_boxed`,
`math_verify_answer_line`.
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


# ----------------------------------------------------------------------------- the DAPO rule
# verl's reward_score/math_dapo.py (DAPO's reference scorer), re-implemented: only the last
# DAPO_TAIL_CHARS characters are read; the answer is the text after the last `Answer:` (any
# case, spaces around the colon, to the end of that line); prediction and ground truth are
# normalized alike (`normalize_dapo`) and compared as strings.
DAPO_TAIL_CHARS = 300   # DAPO reads only this tail ("the longest answer in MATH-500 has 159")

_ANSWER = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
# Literal replacements, in order (the reference's table): articles and spaces go, `mbox`
# becomes `text`, "and" inside \text{} becomes a comma, and metres lose their unit.
_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
            ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","),
            ("\\text{m}", "\\text{}"))
# Units, words and TeX spacing deleted wherever they occur (also inside words: "feet" goes
# from "feetball" too - the reference's behaviour, kept so that scores match it).
_DELETE = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
           "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm",
           "gm", "pounds", "meters", "meals", "edges", "students", "childrentickets",
           "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
           "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!",
           "{,}", '"', "\\dots")
_UNWRAP = tuple(re.compile(r"\\" + cmd + r"\{(.*?)\}") for cmd in ("text", "textbf", "overline"))
_BOXED_GREEDY = re.compile(r"\\boxed\{(.*)\}")
_FIRST_MATH = re.compile(r".*?\$(.*?)\$.*")
_FRAC_SHORT = re.compile(r"frac([^{])(.)")
_SQRT_SHORT = re.compile(r"sqrt([^{])")
INVALID = "[INVALID]"


def normalize_dapo(answer: str) -> str:
    """The DAPO reference's normalization of a final answer (prediction or ground truth)."""
    s = answer.split("=")[-1]               # "x = 5" -> " 5"
    for old, new in _REPLACE:
        s = s.replace(old, new)
    for word in _DELETE:
        s = s.replace(word, "")
    # A line holding $...$ keeps only its first $...$ (`.` stops at a newline: per line).
    s = _FIRST_MATH.sub(lambda m: f"${m.group(1)}$", s)
    for pattern in _UNWRAP:
        s = pattern.sub(lambda m: m.group(1), s)
    s = _BOXED_GREEDY.sub(lambda m: m.group(1), s)
    s = _FRAC_SHORT.sub(lambda m: "frac{" + m.group(1) + "}{" + m.group(2) + "}", s)
    s = _SQRT_SHORT.sub(lambda m: "sqrt{" + m.group(1) + "}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():        # "1,000" -> "1000"
        s = s.replace(",", "")
    return s.strip()


def dapo_prediction(response: str) -> str | None:
    """The DAPO rule's extracted answer (before normalization), None when there is none."""
    found = _ANSWER.findall(response[-DAPO_TAIL_CHARS:])
    return found[-1] if found else None


def dapo_score(response: str, ground_truth: str) -> float:
    """+1 when the normalized last `Answer:` of the response's tail equals the normalized
    ground truth, else -1."""
    pred = dapo_prediction(response)
    pred = normalize_dapo(INVALID if pred is None else pred)
    return 1.0 if pred == normalize_dapo(str(ground_truth)) else -1.0
