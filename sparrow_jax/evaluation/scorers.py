"""Scorers for benchmark evaluation and which one a data row uses.

  dapo         the DAPO-Math rule (verl's `reward_score/math_dapo.py`, DAPO's reference): only
               the last 300 characters of the response are read; the answer is the text after
               the last `Answer:` (any case, spaces allowed around the colon, to the end of
               that line); prediction and ground truth go through the same Minerva-style
               normalization (`normalize_dapo`) and must match as strings. Reward +1 / -1.
  math_verify  math-verify on the last `\\boxed{}` (`sparrow_jax.rewards.math_rewards`):
               symbolic/numeric equivalence, reward 1 / 0.

A response is *correct* when its reward is > 0 (so +1/-1 and 1/0 rewards count alike).
`scorer_for` picks the scorer of a row: an explicit name wins; otherwise its `data_source`
(verl's convention: `math_dapo` and `aime*` are DAPO-scored, the synthetic demo task is scored by
`synthetic_exact`, everything else by math-verify). `answer_key` is the extracted answer the
majority vote counts.
"""

from __future__ import annotations


from sparrow_jax.rewards.answers import dapo_prediction, extract_answer, normalize_dapo

SYNTHETIC_SOURCES = ("sparrow_synthetic", "synthetic")


SCORER_REWARDS = {"dapo": "dapo", "math_verify": "math_verify_boxed"}


def scorer_for(data_source: object, explicit: str | None = None) -> str:
    """The reward name scoring a row: `explicit` (a scorer above or any registered reward name)
    when given, else by the row's `data_source`."""
    if explicit:
        return SCORER_REWARDS.get(explicit, explicit)
    source = str(data_source or "").lower()
    if source == "math_dapo" or source.startswith("aime"):
        return "dapo"
    if source in SYNTHETIC_SOURCES:
        return "synthetic_exact"
    return "math_verify_boxed"


def answer_key(reward: str, response: str) -> str | None:
    """The answer a response gives, as the majority vote compares it (None: no answer).

    dapo: the normalized prediction; math-verify rewards: the extracted answer without spaces;
    other rewards (exact-match tasks): the whole response, stripped."""
    name = reward.split(":")[-1]
    if name == "dapo":
        pred = dapo_prediction(response)
        return None if pred is None else normalize_dapo(pred)
    if name.startswith("math_verify"):
        formats = {"math_verify_boxed": ("boxed",),
                   "math_verify_answer_line": ("answer_line",)}.get(name, ("boxed", "answer_line"))
        found = extract_answer(response, formats)
        return None if found is None or not found.strip() else "".join(found.split())
    return response.strip() or None
