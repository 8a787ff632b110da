"""A generated preference task: answers that transform a digit prompt, against corrupted ones.

Each pair's prompt is a few random digits followed by a separator; the chosen answer is the
prompt's digits sorted (or reversed) and closed with an end token; the rejected answer is that
same answer with one digit replaced by another. Telling them apart needs the model to relate
the answer to the prompt. On the sorting task a two-layer decoder trained from scratch with DPO
reaches about 95% held-out preference accuracy in 150 steps of 32 pairs (see
``benchmarks/dpo_step.py``); reversal is harder for such a model and learns more slowly. The
task checks that preference training learns something, with an accuracy anyone can recompute.
Nothing is downloaded.

Token ids: 0 padding, 1 separator, 2 end, ``3 + d`` for digit ``d`` (``VOCAB = 13``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["DIGIT", "END", "SEP", "VOCAB", "digit_preferences"]

SEP, END, DIGIT = 1, 2, 3
VOCAB = DIGIT + 10
_KINDS = ("sort", "reverse")


def _answer(digits: np.ndarray, kind: str) -> np.ndarray:
    return digits[::-1] if kind == "reverse" else np.sort(digits)


def digit_preferences(
    count: int,
    *,
    min_digits: int = 3,
    max_digits: int = 6,
    kind: str = "sort",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Generate ``count`` preference rows in the ``PreferencePairs`` format.

    Args:
        count: number of pairs.
        min_digits: fewest prompt digits (>= 1).
        max_digits: most prompt digits; rows are at most ``2 * max_digits + 2`` tokens.
        kind: ``"sort"`` (the answer is the digits in ascending order) or ``"reverse"``
            (the digits backwards).
        seed: seed of the generator; the same arguments give the same rows.

    Returns:
        Dicts with ``chosen``, ``rejected`` (prompt, separator, answer, end token) and
        ``chosen_mask``, ``rejected_mask`` (0 on the prompt and separator, 1 on the answer
        and end token).

    Raises:
        ValueError: a count below 1, digit bounds out of order or below 1, or an unknown kind.

    Example:
        >>> row = digit_preferences(1, min_digits=3, max_digits=3, seed=1)[0]
        >>> len(row["chosen"]), row["chosen_mask"]
        (8, [0, 0, 0, 0, 1, 1, 1, 1])
        >>> sum(a != b for a, b in zip(row["chosen"], row["rejected"]))
        1
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count is {count!r}; expected an int >= 1")
    if not (isinstance(min_digits, int) and isinstance(max_digits, int)) or not (
        1 <= min_digits <= max_digits
    ):
        raise ValueError(
            f"min_digits={min_digits!r}, max_digits={max_digits!r}; expected ints with "
            "1 <= min_digits <= max_digits"
        )
    if kind not in _KINDS:
        raise ValueError(f"kind is {kind!r}; expected one of {_KINDS}")
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        digits = rng.integers(0, 10, rng.integers(min_digits, max_digits + 1))
        answer = _answer(digits, kind)
        wrong = answer.copy()
        at = rng.integers(len(wrong))
        wrong[at] = (wrong[at] + rng.integers(1, 10)) % 10  # always a different digit
        prompt = [*(digits + DIGIT).tolist(), SEP]
        chosen = [*prompt, *(answer + DIGIT).tolist(), END]
        rejected = [*prompt, *(wrong + DIGIT).tolist(), END]
        mask = [0] * len(prompt) + [1] * (len(answer) + 1)
        rows.append(
            {"chosen": chosen, "rejected": rejected, "chosen_mask": mask, "rejected_mask": mask}
        )
    return rows
