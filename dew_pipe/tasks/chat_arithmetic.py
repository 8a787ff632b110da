"""One generator for a whole SFT → DPO → GRPO chain: arithmetic as chat conversations.

:class:`ChatArithmetic` draws problems from an :class:`~dew_pipe.tasks.ArithmeticTask` (its
character tokenizer, held-out split and exact-match rule) and gives each stage of a chain its
data in the spec's layouts, all from the same problems stream:

* **SFT**: conversations ``[{"role": "user", "content": "37+485="}, {"role": "assistant",
  "content": "225"}]`` (the answer in the task's format), written as a JSON-lines file for
  :class:`~dew_pipe.data.ChatMessages`, which renders them with the tokenizer's chat template;
* **DPO**: preference pairs: the prompt followed by the true answer (chosen) or by a near miss
  (rejected), both ending in EOS, with completion masks, for
  :class:`~dew_pipe.data.PreferencePairs`. The near miss is the answer a model that forgot a
  carry would write (each column's digit sum mod 10) when the problem has a carry; otherwise
  the answer off by 1 or 10, either way;
* **GRPO**: prompts as chat messages for :class:`~dew_pipe.data.Prompts`, with the ground
  truth, and :meth:`ChatArithmetic.reward` for a chain's rollout, which hands the reward the
  sampled ids as token-ID text (``"7 6 9 2"``): the reward decodes them with the task's
  tokenizer and applies the task's exact-match rule (cut at the first ``</s>``; the ids a
  chain samples after EOS are ignored).

The three draws are disjoint slices of one stream of training problems, so no stage trains on
another stage's problems; held-out problems never appear in any of them.

Example:
    >>> chat = ChatArithmetic(seed=0, digits=2)
    >>> chat.conversations(1)[0]["messages"][0]["role"]
    'user'
    >>> pair = json.loads(chat.pair_records(1)[0])
    >>> n = pair["chosen_mask"].index(1)   # where the answers start
    >>> pair["chosen"][:n] == pair["rejected"][:n], pair["chosen"][n:] != pair["rejected"][n:]
    (True, True)
    >>> chat.reward(chat.data_source, "6 5 2 9", "12", "")   # "21</s>5": 21 reversed is 12
    1.0
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.tasks.arithmetic import EOS_ID, ArithmeticTask
from dew_pipe.tasks.arithmetic import reward as exact_match
from dew_pipe.tasks.problems import Problems, format_answer

__all__ = ["ChatArithmetic"]

_SFT, _DPO, _GRPO = 0, 1, 2  # the stages' slices of one training-problems stream


class ChatArithmetic:
    """SFT conversations, preference pairs, GRPO prompts and the reward of one arithmetic task.

    Args:
        seed, digits, operations, answer_format, test_size: as :class:`ArithmeticTask`.
        sizes: how many problems each stage gets: ``(conversations, pairs, prompts)``.

    Raises:
        TypeError, ValueError: a setting of the wrong type or out of range, named.
    """

    def __init__(
        self,
        seed: int = 0,
        digits: int = 3,
        *,
        operations: str = "+",
        answer_format: str = "reversed",
        test_size: int = 1000,
        sizes: tuple[int, int, int] = (20000, 4000, 4000),
    ) -> None:
        self.task = ArithmeticTask(
            seed=seed,
            digits=digits,
            operations=operations,
            answer_format=answer_format,
            test_size=test_size,
        )
        if not isinstance(sizes, tuple) or len(sizes) != 3:
            raise TypeError(f"sizes is {sizes!r}; expected (conversations, pairs, prompts)")
        self.sizes = tuple(check_int(f"sizes[{i}]", n, minimum=1) for i, n in enumerate(sizes))
        self.data_source = self.task.data_source
        self.eos_id = EOS_ID
        self.pad_id = self.task.pad_id

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt in ids (the chat template adds none)."""
        return self.task.max_prompt_len

    @property
    def max_new_tokens(self) -> int:
        """The longest answer and its EOS, in ids."""
        return self.task.max_new_tokens

    def tokenizer(self) -> Any:
        """The task's character tokenizer (its chat template writes a user turn as its text and
        an assistant turn as its text and ``</s>``)."""
        return self.task.tokenizer()

    def _problems(self, stage: int, n: int | None) -> Problems:
        """Problems of one stage: slice ``stage`` of the training stream, its first ``n``."""
        limit = self.sizes[stage]
        n = limit if n is None else check_int("n", n, minimum=1, maximum=limit)
        start = sum(self.sizes[:stage])
        everything = self.task.problems("train", sum(self.sizes))
        return everything.take(np.arange(start, start + n))

    # --- SFT ---------------------------------------------------------------------------

    def conversations(self, n: int | None = None) -> list[dict[str, Any]]:
        """The SFT rows, ``{"messages": [user, assistant]}``; default ``sizes[0]`` of them."""
        problems = self._problems(_SFT, n)
        return [
            {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": t}]}
            for p, t in zip(
                problems.prompts(), problems.targets(self.task.answer_format), strict=True
            )  # fmt: skip
        ]

    def write_conversations(self, path: str | Path, n: int | None = None) -> Path:
        """Write :meth:`conversations` as JSON lines to ``path`` (for ``ChatMessages``)."""
        path = Path(path)
        path.write_text("".join(json.dumps(row) + "\n" for row in self.conversations(n)))
        return path

    # --- DPO ---------------------------------------------------------------------------

    def near_misses(self, problems: Problems) -> np.ndarray:
        """A wrong answer per problem: the no-carry sum where that differs, else +-1 or +-10.

        Deterministic in the task seed and the problems.
        """
        answers = problems.answers()
        wrong = np.zeros_like(answers)
        digits = self.task.digits + 1
        place = 10 ** np.arange(digits, dtype=np.int64)
        rng = np.random.default_rng([self.task.seed, 7, len(problems)])
        for i, (a, b, op, answer) in enumerate(
            zip(problems.left, problems.right, problems.ops, answers, strict=True)
        ):
            guess = answer
            if op == 0:  # addition: each column's digits summed mod 10, no carries
                column = ((a // place) % 10 + (b // place) % 10) % 10
                guess = int(column @ place)
            while guess == answer or guess < 0:
                guess = int(answer + rng.choice([-10, -1, 1, 10]))
            wrong[i] = guess
        return wrong

    def pair_records(self, n: int | None = None) -> tuple[str, ...]:
        """The DPO pairs as JSON records for ``PreferencePairs(records=...)``.

        Each holds ``chosen`` (prompt ids, the true answer's ids, EOS), ``rejected`` (prompt
        ids, the near miss's ids, EOS) and masks that mark the answer and EOS with 1.
        """
        problems = self._problems(_DPO, n)
        encode = self.tokenizer().encode
        fmt = self.task.answer_format
        records = []
        for prompt, right, wrong in zip(
            problems.prompts(), problems.answers().tolist(), self.near_misses(problems).tolist(),
            strict=True,
        ):  # fmt: skip
            ids = encode(prompt)
            chosen = encode(format_answer(right, fmt)) + [EOS_ID]
            rejected = encode(format_answer(wrong, fmt)) + [EOS_ID]
            records.append(
                json.dumps(
                    {
                        "chosen": ids + chosen,
                        "rejected": ids + rejected,
                        "chosen_mask": [0] * len(ids) + [1] * len(chosen),
                        # the near miss is wrong in its digits, not in ending: its EOS
                        # counts for nothing, so DPO never learns to keep answers from ending
                        "rejected_mask": [0] * len(ids) + [1] * (len(rejected) - 1) + [0],
                    }
                )
            )
        return tuple(records)

    @property
    def pair_width(self) -> int:
        """The widest pair side in ids: the ``seq_len`` of ``PreferencePairs``."""
        return self.max_prompt_len + self.max_new_tokens

    # --- GRPO ---------------------------------------------------------------------------

    def prompt_records(self, n: int | None = None) -> list[dict[str, Any]]:
        """The GRPO prompts for ``Prompts(records=..., tokenizer=...)``: chat messages with
        the data source and ground truth."""
        problems = self._problems(_GRPO, n)
        return [
            {
                "prompt": [{"role": "user", "content": prompt}],
                "data_source": self.data_source,
                "ground_truth": truth,
                "extra_info": {"index": i},
            }
            for i, (prompt, truth) in enumerate(
                zip(problems.prompts(), problems.ground_truths(), strict=True)
            )
        ]

    def reward(
        self, data_source: str, completion: str, ground_truth: str, extra_info: str
    ) -> float:
        """1.0 when the token-ID text ``completion`` states the answer exactly, else 0.0.

        ``completion`` is what a chain's rollout hands the reward: the sampled ids in decimal,
        separated by spaces. They are decoded with the task's tokenizer (``</s>`` kept) and
        scored by the task's exact-match rule, which cuts at the first ``</s>``.

        Raises:
            ValueError: ``completion`` that is not decimal ids of the task's vocabulary, or an
                unknown ``data_source``.
        """
        try:
            ids = [int(part) for part in completion.split()]
        except ValueError as error:
            raise ValueError(
                f"completion {completion[:40]!r} is not token-ID text; expected decimal ids "
                "separated by spaces"
            ) from error
        return exact_match(data_source, self.task.decode(ids), ground_truth, extra_info)

    def evaluate(self, model: Any, variables: Any, n: int | None = None) -> float:
        """Held-out greedy exact match (:meth:`ArithmeticTask.evaluate`, EOS stops)."""
        return self.task.evaluate(model, variables, "test", n, batch=min(500, n or 500))
