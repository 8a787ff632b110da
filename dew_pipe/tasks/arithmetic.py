"""A generated arithmetic task: prompts, SFT rows, a reward and exact-match evaluation.

:class:`ArithmeticTask` turns a seed and a difficulty (operand digits, operations, answer
format) into everything a post-training job needs, with nothing downloaded:

* a character-level tokenizer (:func:`~dew_pipe.tasks.char_tokenizer.build_char_tokenizer`):
  digits as single tokens are what lets a decoder of a few hundred thousand parameters learn
  carries in minutes, where a BPE vocabulary would spell ``485`` as one arbitrary token in one
  problem and two in the next;
* endless SFT batches in the LM layout (prompt ids with role USER, answer and EOS with role
  ASSISTANT, packed into rows with segment ids and positions);
* GRPO prompt records in the :class:`~dew_pipe.data.Prompts` layout, and the reward
  ``reward(data_source, completion, ground_truth, extra_info) -> float``;
* held-out exact-match accuracy of a model by greedy decoding.

Problems, the held-out rule, the answer formats and the exact-match rule are described in
:mod:`dew_pipe.tasks.problems`. Token ids: 0 ``<pad>``, 1 ``<s>``, 2 ``</s>`` (EOS),
3 ``<unk>``, then ``0``-``9``, ``+``, ``-``, ``*``, ``=`` (:data:`VOCAB_SIZE` = 18).

The pieces fit the spec's GRPO interfaces as they are; a synchronous loop reads::

    task = ArithmeticTask(seed=0, digits=3)
    model, sft = train_sft(task, SFTRecipe(), key=jax.random.key(0))   # tasks.recipe
    print(task.evaluate(model, sft.params))                            # held-out exact match
    grpo = GRPOObjective(model, seq_len=task.max_prompt_len + task.max_new_tokens - 1,
                         pretrained=sft.params)
    rollout = SampledRollout(grpo, reward=task.reward, groups=8,
                             max_new_tokens=task.max_new_tokens,
                             sampling=Sampling(eos_id=task.eos_id), decode=task.decode)
    Trainer(grpo, optax.adamw(1e-4), key=jax.random.key(1), rollout=rollout).fit(
        task.prompts("train", 4096).load(batch=16), steps=100)
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from dew_pipe._validate import check_float, check_int
from dew_pipe.data.chat import Role
from dew_pipe.data.dataset import Batch, Dataset, Partition
from dew_pipe.data.packing import ResumableBatches, pack_documents, padded_batches
from dew_pipe.tasks.problems import (
    FORMATS,
    MAX_DIGITS,
    Problems,
    check_operations,
    format_answer,
    held_out,
    is_correct,
    sample_problems,
)

__all__ = ["ALPHABET", "DATA_SOURCE", "VOCAB_SIZE", "ArithmeticTask", "reward"]

ALPHABET = "0123456789+-*="  #: the characters of every prompt and answer, ids 4 onwards
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
VOCAB_SIZE = 4 + len(ALPHABET)
DATA_SOURCE = "arithmetic"  #: data_source is "arithmetic/<answer_format>"
_SPLITS = ("train", "test")
# Independent random streams of one task seed: SFT batch n uses (seed, 0, n).
_SFT_STREAM, _TEST_STREAM, _PROMPT_STREAM = 0, 1, 2
_CHUNK = 1024  # candidate problems drawn at a time
_LOOKUP = np.full(256, UNK_ID, dtype=np.int32)
_LOOKUP[np.frombuffer(ALPHABET.encode("ascii"), np.uint8)] = np.arange(4, VOCAB_SIZE)
_TEXT = np.array(["<pad>", "<s>", "</s>", "<unk>", *ALPHABET])


def reward(data_source: str, completion: str, ground_truth: str, extra_info: str) -> float:
    """1.0 when ``completion`` states the answer exactly, else 0.0 (the GRPO reward).

    The answer format comes from ``data_source`` (``"arithmetic/plain"`` or
    ``"arithmetic/reversed"``, as :attr:`ArithmeticTask.data_source` writes it); the
    exact-match rule is :func:`dew_pipe.tasks.problems.is_correct`. ``extra_info`` is not read.

    Args:
        data_source: ``"arithmetic/<format>"``.
        completion: the decoded completion (``ArithmeticTask.decode`` keeps the ``</s>`` text,
            which the rule cuts at).
        ground_truth: the true answer in canonical decimal.
        extra_info: the row's extra information (JSON text); ignored.

    Raises:
        ValueError: an unknown data_source, or a ground truth that is not canonical decimal.
        TypeError: a non-str completion or ground truth.

    Example:
        >>> reward("arithmetic/reversed", "225</s>", "522", "")
        1.0
        >>> reward("arithmetic/plain", "225</s>", "522", "")
        0.0
    """
    return float(is_correct(completion, ground_truth, _answer_format(data_source)))


def _answer_format(data_source: str) -> str:
    """The answer format a ``data_source`` names (``"arithmetic/<format>"``), checked."""
    prefix, _, answer_format = str(data_source).partition("/")
    if prefix != DATA_SOURCE or answer_format not in FORMATS:
        raise ValueError(
            f"data_source is {data_source!r}; expected one of "
            f"{[f'{DATA_SOURCE}/{f}' for f in FORMATS]}"
        )
    return answer_format


def _encode(texts: list[str]) -> list[np.ndarray]:
    """Character ids of each text, as the task's tokenizer would give them."""
    lengths = np.fromiter(map(len, texts), np.int64, len(texts))
    ids = _LOOKUP[np.frombuffer("".join(texts).encode("ascii"), np.uint8)]
    return np.split(ids, np.cumsum(lengths)[:-1])


class _SFTBatches(ResumableBatches):
    """Endless SFT batches; global batch n depends only on (seed, n), so resume is exact."""

    def __init__(self, task: ArithmeticTask, batch: int, width: int, partition: Partition):
        super().__init__(batch, partition)
        self.task, self.width = task, width

    def batch_at(self, n: int) -> dict[str, np.ndarray]:
        rows = self.task.sft_rows(n, self.batch, self.width)
        return {k: v[self.offset : self.offset + self.local] for k, v in rows.items()}


class ArithmeticTask:
    """Multi-digit arithmetic with exact answers, generated from a seed.

    Args:
        seed: seeds every draw and the held-out hash; equal arguments give equal data.
        digits: the most digits an operand has (1 to 9).
        min_digits: the fewest (1 to ``digits``).
        operations: the operations drawn from, a str such as ``"+"`` or ``"+-*"``.
        answer_format: ``"reversed"`` (least significant digit first; the default, since a
            small decoder learns it far faster) or ``"plain"``; see
            :mod:`dew_pipe.tasks.problems`.
        holdout: share of all problems held out for testing, in (0, 0.5].
        test_size: problems in the test split (drawn from the held-out problems, repeats
            possible).

    Raises:
        TypeError, ValueError: a setting of the wrong type or out of range, named.

    Example:
        >>> task = ArithmeticTask(seed=0, digits=3)
        >>> task.records("test", 1)[0]["prompt"][-1], task.data_source
        ('=', 'arithmetic/reversed')
        >>> task.reward("arithmetic/reversed", "225</s>", "522", "")
        1.0
    """

    reward = staticmethod(reward)

    def __init__(
        self,
        seed: int = 0,
        digits: int = 3,
        *,
        min_digits: int = 1,
        operations: str = "+",
        answer_format: str = "reversed",
        holdout: float = 0.05,
        test_size: int = 1000,
    ) -> None:
        self.seed = check_int("seed", seed, minimum=0, maximum=2**63 - 1)
        self.digits = check_int("digits", digits, minimum=1, maximum=MAX_DIGITS)
        self.min_digits = check_int("min_digits", min_digits, minimum=1, maximum=self.digits)
        self.operations = check_operations(operations)
        if answer_format not in FORMATS:
            raise ValueError(f"answer_format is {answer_format!r}; expected one of {FORMATS}")
        self.answer_format = answer_format
        self.holdout = check_float("holdout", holdout, above=0.0, maximum=0.5)
        self.test_size = check_int("test_size", test_size, minimum=1, maximum=10**7)

    # --- sizes and text --------------------------------------------------------------------

    @property
    def data_source(self) -> str:
        """The ``data_source`` of every record, ``"arithmetic/<answer_format>"``."""
        return f"{DATA_SOURCE}/{self.answer_format}"

    @property
    def vocab_size(self) -> int:
        """Token ids the model needs (the tokenizer's ``len``)."""
        return VOCAB_SIZE

    eos_id = EOS_ID  #: the id ending every answer (``</s>``); generation stops on it
    pad_id = PAD_ID  #: the id of padding in rows and prompts (``<pad>``)

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt in tokens: two operands, the operation and ``=``."""
        return 2 * self.digits + 2

    @property
    def max_answer_len(self) -> int:
        """The longest answer in characters (sign included), without the EOS token."""
        widths = {"+": self.digits + 1, "-": self.digits + 1, "*": 2 * self.digits}
        return max(widths[op] for op in self.operations)

    @property
    def max_new_tokens(self) -> int:
        """The response budget that fits every answer and its EOS token."""
        return self.max_answer_len + 1

    @functools.cache  # noqa: B019 - one tokenizer per task, kept as long as the task
    def tokenizer(self) -> Any:
        """The task's character-level ``PreTrainedTokenizerFast`` (built once, ~10 ms).

        Save it with ``tokenizer().save_pretrained(directory)`` for ``AutoTokenizer``.
        """
        from dew_pipe.tasks.char_tokenizer import build_char_tokenizer

        return build_char_tokenizer(ALPHABET)

    def reference(self, data_source: str, ground_truth: str, extra_info: str = "") -> np.ndarray:
        """The reply SFT teaches for a problem, as token ids (the answer, then EOS), from
        the reward's fields: a ``SampledRollout(guide=task.reference)``.

        Raises:
          ValueError: an unknown data_source, or a ground truth that is not an integer.

        Example:
            >>> ArithmeticTask(seed=0).reference("arithmetic/reversed", "522").tolist()
            [6, 6, 9, 2]
        """
        answer_format = _answer_format(data_source)
        try:
            value = int(ground_truth)
        except (TypeError, ValueError):
            raise ValueError(
                f"ground_truth is {ground_truth!r}; expected an integer in decimal"
            ) from None
        answer = _encode([format_answer(value, answer_format)])[0]
        return np.concatenate([answer, [EOS_ID]]).astype(np.int32)

    def decode(self, ids: Any) -> str:
        """Text of token ids with special tokens spelled out (``</s>`` kept), like
        ``tokenizer().decode`` but without building it; pass it as a rollout's ``decode``."""
        array = np.asarray(ids, dtype=np.int64).reshape(-1)
        if array.size and (array.min() < 0 or array.max() >= VOCAB_SIZE):
            raise ValueError(
                f"ids hold {array.min()}..{array.max()}; expected ids in [0, {VOCAB_SIZE})"
            )
        return "".join(_TEXT[array].tolist())

    # --- problems --------------------------------------------------------------------------

    def _draw(self, rng: np.random.Generator, n: int, *, test: bool) -> Problems:
        """The first ``n`` problems of one split in ``rng``'s stream (rejection sampling).

        Candidates come in chunks of a fixed size, so the first k problems of a longer draw
        are the problems of a draw of k.
        """
        share = self.holdout if test else 1.0 - self.holdout
        parts, have = [], 0
        for _ in range(10 * int(n / (share * _CHUNK)) + 10):  # ~10x the expected chunks
            chunk = sample_problems(
                rng,
                _CHUNK,
                min_digits=self.min_digits,
                max_digits=self.digits,
                operations=self.operations,
            )
            kept = chunk.take(held_out(chunk, self.seed, self.holdout) == test)
            parts.append(kept.take(np.arange(min(len(kept), n - have))))
            have += len(parts[-1])
            if have == n:
                return Problems.concatenate(parts)
        split = "test" if test else "train"
        raise ValueError(
            f"the {split} split of digits={self.digits}, min_digits={self.min_digits} and "
            f"holdout={self.holdout} yielded {have} of {n} problems; expected a problem space "
            "with room for both splits (raise digits or change holdout)"
        )

    def problems(self, split: str, n: int | None = None, *, start: int = 0) -> Problems:
        """Problems of a split.

        Args:
            split: ``"test"`` (held out; the ``test_size`` test problems) or ``"train"``
                (the training problems, one fixed sequence per seed; SFT batches draw their
                own).
            n: how many; default ``test_size``.
            start: where in the split's sequence they begin: problems ``start`` to
                ``start + n - 1``. A job that trains on the first ``k`` training problems
                can check itself on the ``n`` from ``start=k``, draws it never trained on,
                without touching the test split. (The training sequence is independent
                draws, so a problem there comes again as often as in any fresh sample:
                mostly those with one- and two-digit operands, of which there are few.)

        Raises:
            ValueError: an unknown split, or ``n`` or ``start`` out of range (past the
                ``test_size`` test problems, for the test split).
        """
        if split not in _SPLITS:
            raise ValueError(f"split is {split!r}; expected one of {_SPLITS}")
        limit = self.test_size if split == "test" else 10**7
        n = self.test_size if n is None else check_int("n", n, minimum=1, maximum=limit)
        check_int("start", start, minimum=0, maximum=limit - n)
        if split == "test":
            return self._test_problems().take(np.arange(start, start + n))
        rng = np.random.default_rng([self.seed, _PROMPT_STREAM])
        return self._draw(rng, start + n, test=False).take(np.arange(start, start + n))

    @functools.cache  # noqa: B019 - the test split is fixed per task
    def _test_problems(self) -> Problems:
        rng = np.random.default_rng([self.seed, _TEST_STREAM])
        return self._draw(rng, self.test_size, test=True)

    def records(self, split: str, n: int | None = None) -> list[dict[str, Any]]:
        """Prompt records in the layout :class:`~dew_pipe.data.Prompts` reads.

        Each is ``{"prompt": "37+485=", "data_source": "arithmetic/<format>",
        "ground_truth": "522", "extra_info": {"split": ..., "index": i}}``.

        Raises:
            ValueError: as :meth:`problems`.
        """
        problems = self.problems(split, n)
        return [
            {
                "prompt": prompt,
                "data_source": self.data_source,
                "ground_truth": truth,
                "extra_info": {"split": split, "index": i},
            }
            for i, (prompt, truth) in enumerate(
                zip(problems.prompts(), problems.ground_truths(), strict=True)
            )
        ]

    def prompts(self, split: str = "train", n: int | None = None, **options: Any) -> Any:
        """A :class:`~dew_pipe.data.Prompts` of :meth:`records`, tokenized by this task.

        Args:
            split: as :meth:`problems`.
            n: as :meth:`problems`.
            **options: more ``Prompts`` keywords (``shuffle``, ``seed``, ``val_records``...).

        Returns:
            ``Prompts`` with ``max_prompt_len`` = :attr:`max_prompt_len`; call ``.load(batch=B)``.
        """
        from dew_pipe.data.prompts import Prompts

        return Prompts(
            records=self.records(split, n),
            tokenizer=self.tokenizer(),
            max_prompt_len=self.max_prompt_len,
            **options,
        )

    # --- SFT rows --------------------------------------------------------------------------

    def _documents(self, problems: Problems) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Token ids and roles of each problem: prompt (USER), answer and EOS (ASSISTANT)."""
        prompts = _encode(problems.prompts())
        answers = _encode(problems.targets(self.answer_format))
        tokens, roles = [], []
        for p, a in zip(prompts, answers, strict=True):
            tokens.append(np.concatenate([p, a, [EOS_ID]]).astype(np.int32))
            role = np.full(len(p) + len(a) + 1, Role.ASSISTANT, dtype=np.int8)
            role[: len(p)] = Role.USER
            roles.append(role)
        return tokens, roles

    def _check_width(self, width: int) -> None:
        longest = self.max_prompt_len + self.max_new_tokens
        if width < longest:
            raise ValueError(
                f"seq_len is {width - 1}; expected at least {longest - 1} so the longest problem "
                f"({longest} tokens with its EOS) fits a row of seq_len + 1 ids"
            )

    def sft_rows(self, index: int, rows: int, width: int) -> dict[str, np.ndarray]:
        """Global SFT batch ``index``: ``rows`` rows of ``width`` ids, filled with problems.

        Problems go into rows in draw order, each into the current row while it fits, else
        into the next (next-fit). Problem lengths differ by a few ids, so a row loses less
        than one problem's length to padding; the problems drawn beyond the last row are
        unused draws of the generator, not data. Batch ``index`` depends only on the task
        and ``(index, rows, width)``.

        Returns:
            ``text``, ``text_roles``, ``text_segment_ids``, ``text_positions``, each
            ``[rows, width]`` (the LM layout with ``seq_len = width - 1``).
        """
        index = check_int("index", index, minimum=0, maximum=2**63 - 1)
        rows = check_int("rows", rows, minimum=1, maximum=2**31 - 1)
        self._check_width(check_int("width", width, minimum=1, maximum=2**31 - 1))
        rng = np.random.default_rng([self.seed, _SFT_STREAM, index])
        shortest = 2 * self.min_digits + 2 + 2  # one-character answer and EOS
        problems = self._draw(rng, rows * (width // shortest) + 1, test=False)
        tokens, roles = self._documents(problems)
        text = np.full((rows, width), PAD_ID, np.int32)
        text_roles = np.zeros((rows, width), np.int8)
        segments = np.zeros((rows, width), np.int32)
        positions = np.zeros((rows, width), np.int32)
        row, column, segment = 0, 0, 1
        for ids, role in zip(tokens, roles, strict=False):
            if column + len(ids) > width:
                row, column, segment = row + 1, 0, 1
                if row == rows:
                    break
            end = column + len(ids)
            text[row, column:end], text_roles[row, column:end] = ids, role
            segments[row, column:end] = segment
            positions[row, column:end] = np.arange(len(ids))
            column, segment = end, segment + 1
        return {
            "text": text,
            "text_roles": text_roles,
            "text_segment_ids": segments,
            "text_positions": positions,
        }

    def sft_dataset(self, batch: int, seq_len: int, *, val: bool = True) -> Dataset:
        """SFT batches in the LM layout for ``LMObjective(model, seq_len, loss_role=ASSISTANT)``.

        Args:
            batch: rows per global batch.
            seq_len: ``L``; rows hold ``L + 1`` ids. Must fit the longest problem.
            val: give the test split as validation batches (teacher-forced loss and token
                accuracy on held-out answers; packed first-fit, every problem once).

        Returns:
            A :class:`~dew_pipe.data.Dataset`; training batches never end and resume exactly
            (the iterator has ``get_state``/``set_state``). ``records`` is None (unbounded).

        Raises:
            ValueError: ``batch`` below 1 or ``seq_len`` too short for the longest problem.
        """
        batch = check_int("batch", batch, minimum=1, maximum=2**31 - 1)
        width = check_int("seq_len", seq_len, minimum=1, maximum=2**31 - 2) + 1
        self._check_width(width)

        def train(partition: Partition | tuple[int, int]) -> Iterator[Batch]:
            return _SFTBatches(self, batch, width, Partition(*partition))

        def validation(partition: Partition | tuple[int, int]) -> list[Batch]:
            tokens, roles = self._documents(self._test_problems())
            packed = pack_documents(tokens, roles, width, pad_id=PAD_ID)
            return padded_batches(packed, batch, Partition(*partition), pad_id=PAD_ID)

        return Dataset(train=train, val=validation if val else None, records=None, batch=batch)

    # --- evaluation ------------------------------------------------------------------------

    def prompt_arrays(
        self, split: str, n: int | None = None, *, start: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded prompt ids ``[n, max_prompt_len]`` (int32) and their lengths ``[n]``
        (``split``, ``n``, ``start``: as :meth:`problems`)."""
        ids = _encode(self.problems(split, n, start=start).prompts())
        prompts = np.full((len(ids), self.max_prompt_len), PAD_ID, np.int32)
        lengths = np.array([len(x) for x in ids], np.int32)
        for row, values in enumerate(ids):
            prompts[row, self.max_prompt_len - len(values) :] = values
        return prompts, lengths

    def completions(
        self,
        model: Any,
        variables: Any,
        split: str = "test",
        n: int | None = None,
        *,
        batch: int = 500,
        sampling: Any = None,
        key: Any = None,
        start: int = 0,
    ) -> list[str]:
        """The model's completions of a split's prompts, decoded with ``</s>`` kept.

        Generation is :func:`dew_pipe.inference.generation.generate` with a budget of
        :attr:`max_new_tokens` ids, stopping at ``</s>``.

        Args:
            model: a ``causal_transformer`` with ``vocab_size`` >= 18 and ``max_seq_len`` >=
                ``max_prompt_len + max_new_tokens - 1``.
            variables: its ``{"params": ...}``.
            split, n, start: as :meth:`problems`.
            batch: prompts per compiled call (the last call is padded to it, so one compile
                serves every call).
            sampling: a :class:`~dew_pipe.sampling.Sampling`; default greedy (temperature 0).
                Its EOS is always the task's ``</s>``.
            key: PRNG key for sampled completions (call ``c`` uses ``fold_in(key, c)``);
                default ``jax.random.key(0)``.

        Raises:
            ValueError: as :meth:`problems`, or a model too small for the prompts.
        """
        import dataclasses

        import jax

        from dew_pipe.inference.generation import generate_in_chunks
        from dew_pipe.sampling import Sampling

        sampling = Sampling(temperature=0.0) if sampling is None else sampling
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling is {sampling!r}; expected a dew_pipe.sampling.Sampling")
        sampling = dataclasses.replace(sampling, eos_id=EOS_ID)
        key = jax.random.key(0) if key is None else key
        batch = check_int("batch", batch, minimum=1, maximum=2**20)
        prompts, lengths = self.prompt_arrays(split, n, start=start)
        rows = generate_in_chunks(
            model, variables, prompts, lengths, self.max_new_tokens, key, sampling,
            batch=batch, pad_id=PAD_ID,
        )  # fmt: skip
        return [self.decode(row) for row in rows]

    def score(self, completions: list[str], split: str = "test", *, start: int = 0) -> np.ndarray:
        """float ``[n]``: the reward of each completion against the answers of the split's n
        problems from ``start`` (as :meth:`problems`)."""
        truths = self.problems(split, len(completions), start=start).ground_truths()
        return np.array(
            [
                reward(self.data_source, c, t, json.dumps({"split": split}))
                for c, t in zip(completions, truths, strict=True)
            ]
        )

    def evaluate(
        self,
        model: Any,
        variables: Any,
        split: str = "test",
        n: int | None = None,
        *,
        batch: int = 500,
        start: int = 0,
    ) -> float:
        """Exact-match share of greedy completions on a split (the held-out test by default):
        the ``n`` problems from ``start`` (as :meth:`problems`).

        A completion counts when, under the rule of :mod:`dew_pipe.tasks.problems`, it states
        the true answer; the decoded text includes ``</s>`` only when the model produced it
        within :attr:`max_new_tokens`, and an answer followed by anything but EOS is wrong.

        Returns:
            A float in [0, 1].

        Example:
            >>> task.evaluate(model, state.params, "test", n=500)  # doctest: +SKIP
            0.962
        """
        texts = self.completions(model, variables, split, n, batch=batch, start=start)
        return float(self.score(texts, split, start=start).mean())

    def sampled_reward(
        self,
        model: Any,
        variables: Any,
        split: str = "train",
        n: int | None = None,
        *,
        temperature: float = 1.0,
        key: Any = None,
        batch: int = 500,
    ) -> float:
        """Mean reward of completions sampled at ``temperature`` on a split's first n prompts.

        The measure GRPO's batches report as ``reward/mean``, taken here without training:
        a job probes it during SFT to see how much signal GRPO will find (a problem the model
        always or never gets right gives a group no advantage).

        Args:
            model, variables, split, n, batch: as :meth:`completions`.
            temperature: the sampling temperature (> 0).
            key: PRNG key of the draws; default ``jax.random.key(0)``.

        Returns:
            A float in [0, 1].
        """
        from dew_pipe.sampling import Sampling

        sampling = Sampling(temperature=check_float("temperature", temperature, above=0.0))
        texts = self.completions(
            model, variables, split, n, batch=batch, sampling=sampling, key=key
        )
        return float(self.score(texts, split).mean())
