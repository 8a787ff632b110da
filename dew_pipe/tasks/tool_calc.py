"""A generated tool-use task: multiplication the model answers by calling a calculator.

:class:`ToolCalcTask` turns a seed into everything a multi-turn job needs, with nothing
downloaded:

* problems ``"37*48="`` drawn and held out as :mod:`dew_pipe.tasks.problems` does (a hashed
  split, disjoint by construction), with their exact answers;
* a character tokenizer over :data:`~dew_pipe.tasks.tool_calc_worker.ALPHABET`;
* the tool, :mod:`dew_pipe.tasks.tool_calc_worker`: a calculator episode as a JSON-lines
  worker program for :class:`~dew_pipe.objectives.rl.SubprocessEnvironment`
  (:meth:`ToolCalcTask.environment`), or the same code in-process
  (:meth:`ToolCalcTask.local_environment`);
* the verifier (1 for a completed episode whose answer is exact, else 0) and held-out
  success of a greedy rollout server through :class:`~dew_pipe.inference.EnvironmentSource`;
* SFT transcripts in the LM layout for a warm-up (``train_sft`` from
  :mod:`dew_pipe.tasks.recipe` takes this task as it takes an ``ArithmeticTask``).

An episode is ``37*48=`` then turns: ``#37*48</s>`` calls the calculator, which appends
``@1776``; ``A1776</s>`` answers. Every turn states its kind with its first id, so whether
the model reaches for the tool is one decision per turn. A decoder of 0.1 M parameters
cannot multiply three-digit numbers in its head, but it learns to copy an expression into a
call and a result into an answer within a few hundred SFT steps.

The warm-up teaches both kinds of turn: a share ``tool_share`` of its transcripts call the
tool, the rest answer at once (the right answer, which the model fails to learn). After it
the model calls the tool in about ``tool_share`` of its samples and, under greedy decoding,
answers directly and almost always wrongly. Reinforcement learning on the verifier's reward
is then what teaches it *when* to use the tool; a held-out success that moves from near zero
to near one is that lesson, not memorized answers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dew_pipe._validate import check_float, check_int
from dew_pipe.data.chat import Role
from dew_pipe.data.dataset import Dataset, Partition
from dew_pipe.tasks import tool_calc_worker as tool
from dew_pipe.tasks.arithmetic import ArithmeticTask, _SFTBatches
from dew_pipe.tasks.problems import Problems

__all__ = ["DATA_SOURCE", "LocalCalculator", "ToolCalcTask", "WORKER"]

DATA_SOURCE = "tool_calc"
WORKER = str(Path(tool.__file__).resolve())  #: the worker program's path
_SFT_STREAM = 3  # random stream of SFT batches (others: ArithmeticTask's)


class LocalCalculator:
    """The calculator as an in-process Environment (the worker's code, no process).

    Args:
        problem: the problem text, ``"37*48="``.

    Example:
        >>> from dew_pipe.objectives.rl import Action
        >>> with LocalCalculator("3*4=") as env:
        ...     first = env.reset()
        ...     call = tool.encode("#3*4") + [tool.EOS]
        ...     env.step(Action(first.context, call, [0.0] * 5, [0.0] * 5, True, 0)).context
        array([ 7, 16,  8, 17, 18,  7, 16,  8,  2, 19,  5,  6], dtype=int32)
    """

    def __init__(self, problem: str) -> None:
        self.tool = tool.Calculator(problem)

    def __enter__(self) -> LocalCalculator:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def reset(self) -> Any:
        from dew_pipe.objectives.rl.episodes import Observation

        return Observation(**self.tool.reset())

    def step(self, action: Any) -> Any:
        from dew_pipe.objectives.rl.episodes import Observation

        return Observation(**self.tool.step(action.tokens.tolist(), bool(action.stopped)))

    def get_state(self) -> bytes:
        return self.tool.get_state()

    def set_state(self, state: bytes) -> None:
        self.tool.set_state(state)


class ToolCalcTask:
    """Arithmetic answered with a calculator tool, generated from a seed.

    Args:
        seed: seeds every draw and the held-out hash.
        digits: the most digits an operand has (1 to 9).
        min_digits: the fewest (1 to ``digits``).
        operations: the problems' operations (``"*"`` by default; the tool does ``+ - *``).
        holdout: share of all problems held out for testing, in (0, 0.5].
        test_size: problems in the test split.
        tool_share: share of SFT transcripts that call the tool, in [0, 1].
        max_turns: T, the most model calls per episode (>= 2: a call and an answer).

    Raises:
        TypeError, ValueError: a setting of the wrong type or out of range, named.

    Example:
        >>> task = ToolCalcTask(seed=0)
        >>> t = task.tasks("test", 1)[0]
        >>> task.problem_text(t), t.data["ground_truth"] == str(62 * 21)
        ('62*21=', True)
        >>> task.max_prompt_tokens, task.max_new_tokens, task.vocab_size
        (30, 7, 22)
    """

    eos_id = tool.EOS  #: the id ending every turn (``</s>``)
    pad_id = tool.PAD

    def __init__(
        self,
        seed: int = 0,
        digits: int = 2,
        *,
        min_digits: int = 2,
        operations: str = "*",
        holdout: float = 0.05,
        test_size: int = 200,
        tool_share: float = 0.4,
        max_turns: int = 3,
    ) -> None:
        self.problem_source = ArithmeticTask(
            seed, digits, min_digits=min_digits, operations=operations, answer_format="plain",
            holdout=holdout, test_size=test_size,
        )  # fmt: skip
        self.seed, self.digits = self.problem_source.seed, self.problem_source.digits
        self.tool_share = check_float("tool_share", tool_share, minimum=0.0, maximum=1.0)
        self.max_turns = check_int("max_turns", max_turns, minimum=2)

    # --- sizes ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Token ids the model needs: four specials and the alphabet."""
        return 4 + len(tool.ALPHABET)

    @property
    def max_prompt_len(self) -> int:
        """The longest problem in ids (two operands, the operation and ``=``)."""
        return self.problem_source.max_prompt_len

    @property
    def _answer_len(self) -> int:
        return self.problem_source.max_answer_len

    @property
    def max_new_tokens(self) -> int:
        """R: the longest turn with its EOS (a call ``#a*b`` or an answer ``A...``)."""
        return max(2 * self.digits + 3, self._answer_len + 2)

    @property
    def max_prompt_tokens(self) -> int:
        """P: the context after ``max_turns - 1`` calls, so an answer can follow the last."""
        call = 2 * self.digits + 3  # "#", the expression, EOS
        result = 1 + self._answer_len  # "@" and the result
        return self.max_prompt_len + (self.max_turns - 1) * (call + result)

    @property
    def width(self) -> int:
        """P + R: ids per packed row (``GRPOObjective(seq_len=width - 1)``)."""
        return self.max_prompt_tokens + self.max_new_tokens

    def tokenizer(self) -> Any:
        """The task's character ``PreTrainedTokenizerFast`` (ids as the worker numbers them)."""
        from dew_pipe.tasks.char_tokenizer import build_char_tokenizer

        return build_char_tokenizer(tool.ALPHABET)

    decode = staticmethod(tool.decode)

    # --- problems and tasks ----------------------------------------------------------------

    def problems(self, split: str, n: int | None = None) -> Problems:
        """Problems of a split, as ``ArithmeticTask.problems`` draws them."""
        return self.problem_source.problems(split, n)

    def records(self, split: str, n: int | None = None) -> list[dict[str, Any]]:
        """Prompt records (prompt ids, ``data_source``, ``ground_truth``) for ``Prompts``."""
        problems = self.problems(split, n)
        return [
            {"prompt": tool.encode(p), "data_source": DATA_SOURCE, "ground_truth": g,
             "extra_info": ""}
            for p, g in zip(problems.prompts(), problems.ground_truths(), strict=True)
        ]  # fmt: skip

    def prompts(self, split: str = "train", n: int | None = None, **options: Any) -> Any:
        """A :class:`~dew_pipe.data.Prompts` of :meth:`records` (``.load(batch=B)`` it and
        read it with ``prompt_tasks``)."""
        from dew_pipe.data.prompts import Prompts

        return Prompts(records=self.records(split, n), max_prompt_len=self.max_prompt_len,
                       pad_id=self.pad_id, **options)  # fmt: skip

    def tasks(self, split: str, n: int | None = None) -> list[Any]:
        """The split's problems as Tasks whose payload ``prompt_tasks`` would give."""
        from dew_pipe.objectives.rl.sessions import Task

        return [
            Task(i, {**r, "prompt": np.asarray(r["prompt"], np.int32)})
            for i, r in enumerate(self.records(split, n))
        ]

    @staticmethod
    def problem_text(task: Any) -> str:
        """The problem a Task carries, as text (``"37*48="``)."""
        data = getattr(task, "data", None)
        if not isinstance(data, dict) or "prompt" not in data:
            raise ValueError(
                f"task {getattr(task, 'id', task)!r} carries {data!r}; expected the payload "
                "{'prompt': ids, 'ground_truth': ...} of ToolCalcTask.tasks or prompt_tasks"
            )
        return tool.decode([int(i) for i in data["prompt"]])

    # --- the environment and the verifier --------------------------------------------------

    def command(self) -> list[str]:
        """The worker's argv without its problem (the standard library only, no site)."""
        return [sys.executable, "-I", "-S", WORKER]

    def environment(self, limits: Any = None) -> Callable[[Any, Any], Any]:
        """``environment(task, identity)`` for an EnvironmentSource: each episode runs the
        worker (:mod:`~dew_pipe.tasks.tool_calc_worker`) on the task's problem in a
        :class:`~dew_pipe.objectives.rl.SubprocessEnvironment` under ``limits``
        (default: 2 CPU seconds and 256 MiB for the worker, whose work is tiny; 300 seconds
        for the whole session, which includes its waits for the model, the first of them
        through the server's compiles)."""
        from dew_pipe.objectives.rl.subprocess_environment import SubprocessEnvironment
        from dew_pipe.sandbox.program import SandboxLimits

        if limits is None:
            limits = SandboxLimits(cpu_seconds=2, memory_bytes=256 * 2**20, wall_seconds=300)
        command = self.command()

        def open_episode(task: Any, identity: Any) -> Any:
            factory = SubprocessEnvironment([*command, self.problem_text(task)], limits)
            return factory(identity)

        return open_episode

    def local_environment(self, task: Any, identity: Any = None) -> LocalCalculator:
        """The same episode in-process (no worker process), e.g. for tests."""
        return LocalCalculator(self.problem_text(task))

    @staticmethod
    def verify(task: Any, episode: Any) -> float:
        """1.0 when the episode completed with the task's exact answer, else 0.0."""
        from dew_pipe.objectives.rl.episodes import EpisodeStatus

        right = episode.detail == task.data["ground_truth"]
        return float(episode.status is EpisodeStatus.COMPLETED and right)

    @staticmethod
    def called_tool(episode: Any) -> bool:
        """Whether any turn of ``episode`` called the calculator (began with ``#``)."""
        call = tool.encode(tool.CALL)[0]
        return any(a.tokens.size and int(a.tokens[0]) == call for a in episode.actions)

    def success(
        self,
        server: Any,
        split: str = "test",
        n: int | None = None,
        *,
        environment: Callable[[Any, Any], Any] | None = None,
        workers: int = 32,
        record: Callable[[Any, Any], Any] | None = None,
    ) -> float:
        """Mean verifier reward of one episode per problem, drawn from ``server``.

        Held-out success when ``server`` decodes greedily (its Sampling has temperature 0);
        the sampled success rate otherwise. Failed episodes (INFRA_ERROR) count as 0.

        Args:
            server: a RolloutServer whose EOS is :attr:`eos_id`.
            split, n: the problems (:meth:`problems`).
            environment: ``environment(task, identity)``; default :meth:`environment`.
            workers: episodes at once.
            record: passed to the EnvironmentSource (sees every episode).

        Returns:
            A float in [0, 1].
        """
        from dew_pipe.inference.environment_source import EnvironmentSource

        source = EnvironmentSource(
            server, environment or self.environment(), self.verify,
            max_prompt_tokens=self.max_prompt_tokens, max_new_tokens=self.max_new_tokens,
            max_turns=self.max_turns, workers=workers, seed=self.seed, record=record,
        )  # fmt: skip
        with source:
            futures = [source.submit(t, group=t.id, sample=0, attempt=0)
                       for t in self.tasks(split, n)]  # fmt: skip
            rewards = [f.result().reward or 0.0 for f in futures]
        return float(np.mean(rewards))

    # --- SFT transcripts -------------------------------------------------------------------

    def transcript(self, problem: str, answer: str, use_tool: bool) -> tuple[list[int], list[int]]:
        """One SFT transcript's ids and roles: the problem and the tool's result are USER,
        the model's turns (EOS included) ASSISTANT.

        Example:
            >>> ids, roles = ToolCalcTask().transcript("3*4=", "12", use_tool=True)
            >>> ToolCalcTask.decode(ids)
            '3*4=#3*4</s>@12A12</s>'
        """
        parts: list[tuple[str, int, bool]] = [(problem, Role.USER, False)]
        if use_tool:
            parts += [(tool.CALL + problem[:-1], Role.ASSISTANT, True),
                      (tool.RESULT + tool.calculate(problem[:-1]), Role.USER, False)]  # fmt: skip
        parts.append((tool.ANSWER + answer, Role.ASSISTANT, True))
        ids: list[int] = []
        roles: list[int] = []
        for text, role, turn in parts:
            piece = tool.encode(text) + ([tool.EOS] if turn else [])
            ids += piece
            roles += [int(role)] * len(piece)
        return ids, roles

    def sft_rows(self, index: int, rows: int, width: int) -> dict[str, np.ndarray]:
        """Global SFT batch ``index``: ``rows`` rows of ``width`` ids packed with transcripts,
        each calling the tool with probability ``tool_share``."""
        check_int("index", index, minimum=0)
        check_int("rows", rows, minimum=1)
        longest = self.max_prompt_len + 2 * self.digits + 3 + 2 * self._answer_len + 3
        if check_int("width", width, minimum=1) < longest:
            raise ValueError(f"seq_len is {width - 1}; expected at least {longest - 1} so the "
                             f"longest transcript ({longest} ids) fits a row")  # fmt: skip
        rng = np.random.default_rng([self.seed, _SFT_STREAM, index])
        pool = self.problems("train", 1 << 14)
        picks = pool.take(rng.integers(len(pool), size=rows * (width // 12 + 1)))
        uses = rng.random(len(picks)) < self.tool_share
        out = {
            "text": np.full((rows, width), self.pad_id, np.int32),
            "text_roles": np.zeros((rows, width), np.int8),
            "text_segment_ids": np.zeros((rows, width), np.int32),
            "text_positions": np.zeros((rows, width), np.int32),
        }
        row, column, segment = 0, 0, 1  # next fit, in draw order: the tool share holds per row
        for problem, answer, use in zip(picks.prompts(), picks.ground_truths(), uses, strict=True):
            ids, role = self.transcript(problem, answer, bool(use))
            if column + len(ids) > width:
                row, column, segment = row + 1, 0, 1
                if row == rows:
                    return out
            end = column + len(ids)
            out["text"][row, column:end], out["text_roles"][row, column:end] = ids, role
            out["text_segment_ids"][row, column:end] = segment
            out["text_positions"][row, column:end] = np.arange(len(ids))
            column, segment = end, segment + 1
        raise ValueError(f"SFT batch {index}: the transcripts drawn filled {row} of {rows} rows")

    def sft_dataset(self, batch: int, seq_len: int, *, val: bool = False) -> Dataset:
        """Endless SFT batches for ``LMObjective(model, seq_len, loss_role=ASSISTANT)``,
        resumable by count (``val`` is accepted for ``train_sft`` and must be False)."""
        if val:
            raise ValueError("val is True; ToolCalcTask measures held-out success instead")
        batch = check_int("batch", batch, minimum=1)
        width = check_int("seq_len", seq_len, minimum=1) + 1
        self.sft_rows(0, 1, width)  # checks the width now

        def train(partition: Partition | tuple[int, int]) -> Any:
            return _SFTBatches(self, batch, width, Partition(*partition))

        return Dataset(train=train, val=None, records=None, batch=batch)
