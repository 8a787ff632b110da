"""A generated code-writing task: programs by example, graded by running them on hidden cases.

:class:`CodeTask` turns a seed into everything an RLVR job needs, with nothing downloaded
(the family of programs, the examples and the hidden cases are :mod:`dew_pipe.tasks.programs`):

* a character vocabulary (:data:`ALPHABET`: printable ASCII and the newline, one id each, so
  any program a model writes can be spelled, and a small decoder needs no tokenizer merges
  to learn a program's shape);
* endless SFT batches in the LM layout: the prompt (the examples) with role USER, then the
  reference program as a fenced python block and EOS with role ASSISTANT, packed next-fit
  into rows. A share ``digits_share`` of the reference programs reads its input with the
  ``"digits"`` reader (:data:`~dew_pipe.tasks.programs.READERS`), which reads the examples
  right and the hidden cases wrong: the warm-up data is a corpus that solves the examples,
  not always the task, and only the reward says which reader to keep;
* endless GRPO prompt batches in the ``Prompts`` layout (``prompt``, ``prompt_length``,
  ``data_source``, ``ground_truth``, ``extra_info``), which ``prompt_tasks`` turns into
  the tasks ``PromptSource`` draws from; the ground truth is CodeReward's JSON cases;
* greedy completions of the held-out prompts and their pass rate under any reward with the
  ``reward(data_source, completion, ground_truth, extra_info)`` signature: give it a
  :class:`~dew_pipe.rewards.CodeReward` on a fleet that isolates.

A completion is what the model writes after the prompt: ``"```python\\n<program>```"``,
then EOS. Token ids: 0 ``<pad>``, 1 ``<s>``, 2 ``</s>`` (EOS), 3 ``<unk>``, then
:data:`ALPHABET` (:data:`VOCAB_SIZE` = 100).

Example:
    >>> task = CodeTask(seed=0, test_size=4)
    >>> record = task.records("test", 1)[0]
    >>> record["prompt"].count("\\n"), record["data_source"]
    (3, 'code/by-example')
    >>> print(task.completion("sum"))
    ```python
    a=[*map(int,input().split())]
    print(sum(a))
    ```
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from dew_pipe._validate import check_float, check_int
from dew_pipe.data.chat import Role
from dew_pipe.data.dataset import Batch, Dataset, Partition
from dew_pipe.data.packing import ResumableBatches
from dew_pipe.data.text_columns import encode_text_column
from dew_pipe.tasks.programs import (
    DEFAULT_OPERATIONS,
    OPERATIONS,
    READERS,
    ProgramTask,
    battery,
    check_operations,
    draw_task,
    ground_truth,
    held_out,
)

__all__ = ["ALPHABET", "DATA_SOURCE", "VOCAB_SIZE", "CodeTask", "Scores"]

ALPHABET = "".join(map(chr, range(32, 127))) + "\n"  #: ids 4 onwards
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
VOCAB_SIZE = 4 + len(ALPHABET)
DATA_SOURCE = "code/by-example"
FENCE_OPEN, FENCE_CLOSE = "```python\n", "```"
_SPLITS = ("train", "test")
_SFT_STREAM, _TEST_STREAM, _PROMPT_STREAM = 0, 1, 2  # independent streams of one seed
_LOOKUP = np.full(256, UNK_ID, dtype=np.int32)
_LOOKUP[np.frombuffer(ALPHABET.encode("ascii"), np.uint8)] = np.arange(4, VOCAB_SIZE)
_TEXT = np.array(["<pad>", "<s>", "</s>", "<unk>", *ALPHABET])


def encode(text: str) -> np.ndarray:
    """int32 ids of ``text``, one per character (those outside :data:`ALPHABET` are ``<unk>``).

    Example:
        >>> encode("a\\té").tolist()
        [69, 3, 3]
    """
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    return np.where(codes < 256, _LOOKUP[np.minimum(codes, 255)], UNK_ID).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Scores:
    """How a set of completions fared.

    Attributes:
      rewards: float ``[n]``, each completion's reward (the share of cases it passed).
      pass_rate: share of completions with reward 1.0 (every case passed).
      mean_reward: the mean of ``rewards``.
    """

    rewards: np.ndarray

    @property
    def pass_rate(self) -> float:
        return float(np.mean(self.rewards == 1.0))

    @property
    def mean_reward(self) -> float:
        return float(np.mean(self.rewards))


class _Rows(ResumableBatches):
    """Endless batches; global batch n depends only on (task, n), so resume is exact."""

    def __init__(self, make: Callable[[int], dict[str, np.ndarray]], batch: int, partition):
        super().__init__(batch, partition)
        self.make = make

    def batch_at(self, n: int) -> dict[str, np.ndarray]:
        rows = self.make(n)
        return {k: v[self.offset : self.offset + self.local] for k, v in rows.items()}


class CodeTask:
    """Programs by example, generated from a seed (see :mod:`dew_pipe.tasks.programs`).

    Args:
        seed: seeds every draw, the hidden battery and the held-out hash.
        operations: the operations tasks are drawn from (names of ``programs.OPERATIONS``,
            a sequence or a comma-separated str); uniform over them.
        examples: examples shown per prompt.
        min_length, max_length: integers per input (examples and hidden cases alike).
        cases: hidden test cases per task (the battery's size).
        digits_share: share of SFT reference programs that read with the ``"digits"``
            reader, in [0, 1].
        holdout: share of prompts held out for testing, in (0, 0.5].
        test_size: tasks in the test split.

    Raises:
        TypeError, ValueError: a setting of the wrong type or out of range, named.
    """

    eos_id = EOS_ID  #: ends every completion; generation stops on it
    pad_id = PAD_ID
    vocab_size = VOCAB_SIZE
    data_source = DATA_SOURCE

    def __init__(
        self,
        seed: int = 0,
        operations: Any = DEFAULT_OPERATIONS,
        *,
        examples: int = 3,
        min_length: int = 2,
        max_length: int = 5,
        cases: int = 4,
        digits_share: float = 0.5,
        holdout: float = 0.05,
        test_size: int = 200,
    ) -> None:
        self.seed = check_int("seed", seed, minimum=0, maximum=2**63 - 1)
        self.operations = check_operations(operations)
        self.examples = check_int("examples", examples, minimum=1, maximum=16)
        self.max_length = check_int("max_length", max_length, minimum=1, maximum=16)
        self.min_length = check_int("min_length", min_length, minimum=1, maximum=self.max_length)
        self.cases = check_int("cases", cases, minimum=1, maximum=64)
        self.digits_share = check_float("digits_share", digits_share, minimum=0.0, maximum=1.0)
        self.holdout = check_float("holdout", holdout, above=0.0, maximum=0.5)
        self.test_size = check_int("test_size", test_size, minimum=1, maximum=10**6)
        self.battery = battery(self.seed, self.cases, self.lengths)
        self._truths = {name: ground_truth(name, self.battery) for name in self.operations}

    @property
    def lengths(self) -> tuple[int, int]:
        return self.min_length, self.max_length

    # --- sizes and text --------------------------------------------------------------------

    @staticmethod
    def completion(operation: str, reader: str = "split") -> str:
        """The reference completion of ``operation``: its program as a fenced python block."""
        return f"{FENCE_OPEN}{OPERATIONS[operation].program(reader)}{FENCE_CLOSE}"

    @functools.cached_property
    def max_prompt_len(self) -> int:
        """The longest prompt in ids: every example at the longest input, all nines."""
        nines = [9] * self.max_length
        line = max(len(OPERATIONS[name].run(nines)) for name in self.operations)
        return self.examples * (2 * self.max_length - 1 + 1 + line + 1)

    @functools.cached_property
    def max_new_tokens(self) -> int:
        """The response budget: the longest reference completion and EOS, plus a quarter
        for programs longer than the references."""
        longest = max(
            len(self.completion(name, reader)) for name in self.operations for reader in READERS
        )
        longest += 1
        return longest + longest // 4

    def decode(self, ids: Any) -> str:
        """Text of ids (special tokens spelled out); pass it as a rollout's ``decode``.

        Raises:
            ValueError: an id outside the vocabulary.
        """
        array = np.asarray(ids, dtype=np.int64).reshape(-1)
        if array.size and (array.min() < 0 or array.max() >= VOCAB_SIZE):
            raise ValueError(
                f"ids hold {array.min()}..{array.max()}; expected ids in [0, {VOCAB_SIZE})"
            )
        return "".join(_TEXT[array].tolist())

    # --- tasks -----------------------------------------------------------------------------

    def _draw(self, rng: np.random.Generator, n: int, *, test: bool) -> list[ProgramTask]:
        """The first ``n`` tasks of one split in ``rng``'s stream."""
        tasks: list[ProgramTask] = []
        for _ in range(100 * n + 100):
            name = self.operations[int(rng.integers(len(self.operations)))]
            task = draw_task(
                rng, name, self.operations, examples=self.examples, lengths=self.lengths
            )
            if held_out(task.prompt, self.seed, self.holdout) == test:
                tasks.append(task)
                if len(tasks) == n:
                    return tasks
        raise ValueError(
            f"the {'test' if test else 'train'} split yielded {len(tasks)} of {n} tasks; "
            "expected room for both splits (change holdout)"
        )

    def tasks(self, split: str, n: int | None = None) -> list[ProgramTask]:
        """Tasks of a split: ``"test"`` (the first ``n`` of the ``test_size`` held-out
        tasks, default all) or ``"train"`` (the first ``n`` of the training stream).

        Raises:
            ValueError: an unknown split, or ``n`` out of range.
        """
        if split not in _SPLITS:
            raise ValueError(f"split is {split!r}; expected one of {_SPLITS}")
        limit = self.test_size if split == "test" else 10**7
        n = self.test_size if n is None else check_int("n", n, minimum=1, maximum=limit)
        if split == "test":
            return self._test_tasks()[:n]
        return self._draw(np.random.default_rng([self.seed, _PROMPT_STREAM, 0]), n, test=False)

    @functools.cache  # noqa: B019 - the test split is fixed per task
    def _test_tasks(self) -> list[ProgramTask]:
        rng = np.random.default_rng([self.seed, _TEST_STREAM])
        return self._draw(rng, self.test_size, test=True)

    def ground_truth(self, operation: str) -> str:
        """CodeReward's JSON cases for ``operation``: it on the seed's hidden battery."""
        return self._truths[operation]

    def records(self, split: str, n: int | None = None) -> list[dict[str, Any]]:
        """Prompt records: ``{"prompt", "data_source", "ground_truth", "extra_info"}``,
        ``extra_info`` holding the split, the index and the operation's name."""
        return [
            {
                "prompt": task.prompt,
                "data_source": DATA_SOURCE,
                "ground_truth": self.ground_truth(task.operation),
                "extra_info": {"split": split, "index": i, "operation": task.operation},
            }
            for i, task in enumerate(self.tasks(split, n))
        ]

    # --- SFT rows --------------------------------------------------------------------------

    def sft_rows(self, index: int, rows: int, width: int) -> dict[str, np.ndarray]:
        """Global SFT batch ``index``: ``rows`` rows of ``width`` ids, next-fit in draw order.

        Each document is a training task's prompt (role USER), its reference completion (with
        the ``"digits"`` reader for a share ``digits_share`` of them) and EOS (role
        ASSISTANT). A row takes documents while they fit, so it loses less than one
        document's length to padding. Batch ``index`` depends only on the task and
        ``(index, rows, width)``.

        Returns:
            ``text``, ``text_roles``, ``text_segment_ids``, ``text_positions``, each
            ``[rows, width]``.

        Raises:
            ValueError: ``width`` below the longest document.
        """
        longest = self.max_prompt_len + self.max_new_tokens
        if width < longest:
            raise ValueError(
                f"seq_len is {width - 1}; expected at least {longest - 1} so the longest "
                f"task ({longest} ids with its EOS) fits a row of seq_len + 1 ids"
            )
        rng = np.random.default_rng([self.seed, _SFT_STREAM, index])
        shape = (rows, width)
        text, roles = np.full(shape, PAD_ID, np.int32), np.zeros(shape, np.int8)
        segments, positions = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
        row, column, segment = 0, 0, 1
        while row < rows:
            (task,) = self._draw(rng, 1, test=False)
            prompt = encode(task.prompt)
            reader = "digits" if rng.random() < self.digits_share else "split"
            answer = np.append(encode(self.completion(task.operation, reader)), EOS_ID)
            size = len(prompt) + len(answer)
            if column + size > width:
                row, column, segment = row + 1, 0, 1
                continue  # this task is an unused draw; the next row starts afresh
            end = column + size
            text[row, column:end] = np.concatenate([prompt, answer])
            roles[row, column : column + len(prompt)] = Role.USER
            roles[row, column + len(prompt) : end] = Role.ASSISTANT
            segments[row, column:end] = segment
            positions[row, column:end] = np.arange(size)
            column, segment = end, segment + 1
        return {
            "text": text,
            "text_roles": roles,
            "text_segment_ids": segments,
            "text_positions": positions,
        }

    def sft_dataset(self, batch: int, seq_len: int) -> Dataset:
        """Endless SFT batches for ``LMObjective(model, seq_len, loss_role=ASSISTANT)``.

        Raises:
            ValueError: ``batch`` below 1 or ``seq_len`` too short for the longest task.
        """
        batch = check_int("batch", batch, minimum=1, maximum=2**31 - 1)
        width = check_int("seq_len", seq_len, minimum=1, maximum=2**31 - 2) + 1
        self.sft_rows(0, 1, width)  # checks the width before any training starts

        def train(partition: Partition | tuple[int, int]) -> Iterator[Batch]:
            return _Rows(lambda n: self.sft_rows(n, batch, width), batch, Partition(*partition))

        return Dataset(train=train, val=None, records=None, batch=batch)

    # --- GRPO prompts ----------------------------------------------------------------------

    def prompt_arrays(self, tasks: list[ProgramTask]) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded prompt ids ``[n, max_prompt_len]`` (int32) and their lengths ``[n]``."""
        ids = [encode(task.prompt) for task in tasks]
        prompts = np.full((len(ids), self.max_prompt_len), PAD_ID, np.int32)
        for row, values in enumerate(ids):
            prompts[row, self.max_prompt_len - len(values) :] = values
        return prompts, np.array([len(x) for x in ids], np.int32)

    def prompt_batch(self, index: int, batch: int) -> dict[str, np.ndarray]:
        """Global GRPO prompt batch ``index`` in the ``Prompts`` layout (task ids
        ``index * batch`` onwards), drawn from the training split."""
        rng = np.random.default_rng([self.seed, _PROMPT_STREAM, 1, index])
        tasks = self._draw(rng, batch, test=False)
        prompts, lengths = self.prompt_arrays(tasks)
        infos = [json.dumps({"split": "train", "operation": t.operation}) for t in tasks]
        return {
            "task_id": np.arange(index * batch, (index + 1) * batch, dtype=np.int64),
            "prompt": prompts,
            "prompt_length": lengths,
            "data_source": encode_text_column([DATA_SOURCE] * batch, field="data_source"),
            "ground_truth": encode_text_column(
                [self.ground_truth(t.operation) for t in tasks], field="ground_truth"
            ),
            "extra_info": encode_text_column(infos, field="extra_info"),
        }

    def prompt_dataset(self, batch: int) -> Dataset:
        """Endless GRPO prompt batches (:meth:`prompt_batch`) for ``TaskBatches``."""
        batch = check_int("batch", batch, minimum=1, maximum=2**20)

        def train(partition: Partition | tuple[int, int]) -> Iterator[Batch]:
            return _Rows(lambda n: self.prompt_batch(n, batch), batch, Partition(*partition))

        return Dataset(train=train, val=None, records=None, batch=batch)

    # --- evaluation ------------------------------------------------------------------------

    def completions(
        self,
        model: Any,
        variables: Any,
        split: str = "test",
        n: int | None = None,
        *,
        batch: int = 200,
        sampling: Any = None,
        key: Any = None,
    ) -> list[str]:
        """The model's completions of a split's prompts (greedy unless ``sampling``).

        The text is cut before the EOS that ended a completion; one that ran out of budget
        is returned as far as it got.
        """
        import jax

        from dew_pipe.inference.generation import generate_in_chunks
        from dew_pipe.sampling import Sampling

        sampling = Sampling(temperature=0.0) if sampling is None else sampling
        sampling = dataclasses.replace(sampling, eos_id=EOS_ID)
        key = jax.random.key(0) if key is None else key
        prompts, lengths = self.prompt_arrays(self.tasks(split, n))
        batch = min(check_int("batch", batch, minimum=1, maximum=2**20), len(prompts))
        rows = generate_in_chunks(
            model, variables, prompts, lengths, self.max_new_tokens, key, sampling,
            batch=batch, pad_id=PAD_ID,
        )  # fmt: skip
        return [self.decode(row[:-1] if len(row) and row[-1] == EOS_ID else row) for row in rows]

    def score(
        self,
        reward: Callable[..., float],
        completions: list[str],
        split: str = "test",
        *,
        cases: str = "hidden",
        threads: int = 8,
    ) -> Scores:
        """The rewards of ``completions`` of a split's first prompts under ``reward``.

        Args:
            reward: ``reward(data_source, completion, ground_truth, extra_info)``.
            completions: one per prompt, in the split's order.
            split: as :meth:`tasks`.
            cases: ``"hidden"`` grades against the task's ground truth (the battery);
                ``"examples"`` against the input/output lines its own prompt shows, which
                tells a program that solves what it was shown from one that solves the task.
            threads: the calls run on this many threads (a CodeReward waits on its fleet,
                which bounds the programs running at once).

        Raises:
            ValueError: ``cases`` is neither.
        """
        if cases not in ("hidden", "examples"):
            raise ValueError(f"cases is {cases!r}; expected 'hidden' or 'examples'")
        tasks = self.tasks(split, len(completions))
        if cases == "hidden":
            truths = [self.ground_truth(task.operation) for task in tasks]
        else:
            truths = [ground_truth(task.operation, task.examples) for task in tasks]
        infos = [json.dumps({"split": split, "operation": task.operation}) for task in tasks]
        with cf.ThreadPoolExecutor(threads, thread_name_prefix="code-score") as pool:
            rewards = list(pool.map(reward, [DATA_SOURCE] * len(tasks), completions, truths, infos))
        return Scores(np.asarray(rewards, np.float64))
