"""`SampledRollout`: the trainer's GRPO rollout hook, from a prompt batch to packed rows.

One call turns a ``Prompts`` batch (``prompt [B, P]`` left padded, ``prompt_length [B]``,
reward metadata as ``[B, M]`` UTF-8 byte columns) into the packed ``[N, P + R]`` batch a
``GRPOObjective(seq_len=P + R - 1)`` trains on, with ``N = B * G``:

1. `dew_pipe.inference.generate` samples ``G`` completions of up to ``R`` ids per prompt
   (``repeats=G``: row ``b * G + g`` is sample ``g`` of prompt ``b``; each prompt is
   prefilled once for its group) in one compiled call, under the state's current
   parameters. ``prompt_length`` becomes the
   attention mask: each row attends to its last ``prompt_length`` ids only.
2. Each completion becomes a one-call `Session` (task and group: the prompt row; sample:
   ``g``). A completion that drew EOS is COMPLETED (finish reason ``"stop"``, the EOS kept
   among its sampled ids); one that used the whole budget is TRUNCATED (``"length"``). Both
   are scored and both train (``pack(truncation="score")``), so no completion is dropped.
3. The reward reads strings: the prompt row's ``data_source``, ``ground_truth`` and
   ``extra_info`` decoded from UTF-8, and the completion as ``decode(ids)`` where ``ids``
   are the sampled ids without EOS and padding.
4. ``pack(sessions, width=P + R, rows=N, estimator=...)`` builds the batch: raw model
   log-probabilities land in ``old_log_probs``, the sampler's (after temperature and
   filters) in ``behavior_log_probs``, and ``versions`` holds ``state.updates``. N rows always
   hold the N chains (each chain is at most ``P + R`` ids), so the shape never changes.
   With ``drop_zero_advantage`` the prompts whose advantages all came out 0 are left out,
   N shrinks to the rows the rest need, rounded up to ``row_multiple``, and the kept
   advantages are scaled so that the update is the one the whole batch would give.

With a ``guide``, a prompt whose G completions are all the same reply gets its last
completion replaced by the guide's reference reply when that reply earns more (see
`SampledRollout`), before packing.

After each call :meth:`SampledRollout.metrics` reports the reward mean, the share of
completions with a positive reward, the mean response length, the truncated share, the
share of prompts that train nothing and the batch's rows; the Trainer logs them under
``rollout/``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.data.text_columns import decode_text_column
from dew_pipe.inference.generation import generate
from dew_pipe.inference.reward_function import RewardFunction, join_ids
from dew_pipe.objectives.rl.advantages import ESTIMATORS
from dew_pipe.objectives.rl.packing import TRUNCATIONS, pack, trains
from dew_pipe.objectives.rl.sessions import Call, Session, Status
from dew_pipe.sampling import Sampling

__all__ = ["SampledRollout"]

_METADATA = ("data_source", "ground_truth", "extra_info")


def _integers(batch: Mapping[str, Any], name: str, ndim: int) -> np.ndarray:
    if name not in batch:
        raise ValueError(
            f"batch has no field {name!r}; SampledRollout reads Prompts rows "
            f"(prompt [B, P], prompt_length [B]), fields are {sorted(batch)}"
        )
    array = np.asarray(batch[name])
    if array.dtype.kind not in "iu" or array.ndim != ndim:
        shape = "[B, P]" if ndim == 2 else "[B]"
        raise ValueError(
            f"batch field {name!r} is {array.dtype} with shape {array.shape}; expected "
            f"integers of shape {shape}"
        )
    return array


class SampledRollout:
    """Samples ``groups`` completions per prompt, scores them and packs a GRPO batch.

    Pass it to ``Trainer(..., rollout=rollout)``: the trainer calls it on the host with
    each prompt batch before the compiled update, and trains on the packed rows it returns
    (see the module docstring for the steps).

    Args:
        objective: the objective being trained; its ``model`` samples and its ``seq_len``
            must be ``P + R - 1`` for prompt batches ``P`` ids wide (with ``share_prompts``,
            at least that: it sets the width of the shared rows).
        reward: ``reward(data_source, completion, ground_truth, extra_info) -> float``;
            must return a finite real number. It is called once per completion, on the
            host, prompt by prompt and sample by sample within a prompt.
        groups: G, completions per prompt (at least 2: advantages compare them).
        max_new_tokens: R, the sampling budget per completion (at least 1).
        sampling: EOS ids, temperature and filters (`dew_pipe.sampling.Sampling`).
        decode: turns a completion's ids (a list of ints, EOS and padding removed) into the
            text the reward reads; None writes the ids in decimal separated by spaces
            (`join_ids`). Pass ``tokenizer.decode`` for a reward on words.
        estimator: the advantage estimator ``pack`` applies within each prompt's group:
            ``"group"`` (GRPO), ``"mean"`` (Dr.GRPO) or ``"rloo"``.
        truncation: how completions that ran out of budget train: ``"score"`` (default, on
            their reward like the others), ``"zero"`` (on reward 0) or ``"mask"`` (not at
            all). The reward is called for every completion whatever this says.
        pad_id: the id written after a completion ends (it never reaches the reward or
            the packed rows).
        drop_zero_advantage: pack only the prompts whose completions' advantages are not
            all 0 (``pack(drop_zero_advantage=True)``): a group that is all right or all
            wrong adds nothing to the policy gradient, and late in training most groups
            are one or the other, so the update runs on a fraction of the rows. The batch
            then has as many rows as the kept completions need, rounded up to
            ``row_multiple``. The kept advantages are scaled by the kept share of the
            batch's trained tokens (of its trained completions under the objective's
            ``aggregation="session-mean"``), so the policy loss, its gradient and the
            update are those of the whole batch, to float rounding; only the KL term
            (``beta > 0``) and chains rejected by a sequence mask differ, as the dropped
            completions are not there to count. (Averaging over the kept tokens instead,
            as DAPO's dynamic sampling does, gives a batch of a few mixed groups the
            weight of a batch of many; on the arithmetic task it stalled 10 points lower.)
        row_multiple: with ``drop_zero_advantage``, the batch's rows are a multiple of this;
            None takes an eighth of ``B * G`` (rounded up), so the update compiles for at
            most eight shapes.
        guide: None, or ``guide(data_source, ground_truth, extra_info) -> ids``: the token
            ids of a reference reply to the prompt (ending in an EOS id of ``sampling``, at
            most ``max_new_tokens`` ids), or None where there is none. On-policy sampling
            never draws a reply the policy gives almost no probability, so a prompt whose
            G completions are the same wrong reply trains nothing, however long the run
            (`benchmarks/RESULTS.md`, the embedded job's weak hand-over). With a guide, a
            collapsed group (all G completions the same ids, so the same reward) has its
            last completion replaced by the reference when the reward scores the reference
            higher, so the group has a winner to move towards (off-policy guidance, as in
            LUFFY). Groups whose completions differ are left to sampling even when their
            rewards are all equal: guiding every all-wrong group of a weak policy crowds
            the sampled groups' gradient out under the norm clip (on the arithmetic task
            one seed stalled at 40%). The reference's behavior and old log-probabilities
            are the policy's own at the sampling temperature (one scoring pass over the
            packed batch, under the same parameters), so its importance weight is 1 and
            it trains as if sampled. The rewards in :meth:`metrics` stay those of the
            sampled completions; ``groups/guided`` counts the replaced groups.
        share_prompts: pack each prompt once for all of its G completions
            (``pack(..., share_prompts=True)``), so the update encodes it once instead of G
            times: the loss, its gradient and the update are those of the plain rows to
            float rounding. Rows are then ``seq_len + 1`` ids wide and the batch has
            ``B * ceil(G / k)`` of them, where ``k = (seq_len + 2 - P) // (R + 1)`` is how
            many full-length completions fit beside one full-length prompt; pick
            ``seq_len >= P + G * (R + 1) - 2`` for one row per prompt (the model's
            ``max_seq_len`` must admit rows that wide). Pays off when prompts are long
            against completions (in ``benchmarks/async_vs_sync.py``, prompts of
            up to 64 ids and 24 sampled ids).
        sample_model: the model that samples, on the trained parameters; None is the
            objective's. The same architecture in another compute precision: a float32
            twin of a model whose update multiplies in bfloat16, say, so sampling keeps
            its precision while the update runs on the bfloat16 kernels. Its config may
            differ from the objective model's in ``dtype`` alone.

    Attributes:
        last_sessions: the ``B * G`` one-call sessions of the last call, in packing order
            (``session_index``), with their statuses and rewards (a guided group's last
            one is the reference, as trained).

    Raises:
        TypeError: an objective without ``model``/``seq_len``, a reward or decode that is
            not callable, a ``sampling`` that is not a `Sampling`.
        ValueError: a ``sample_model`` whose config differs from the objective model's
            in more than ``dtype``, ``groups < 2``, ``max_new_tokens < 1``, an unknown estimator or
            truncation, EOS ids outside the model's vocabulary, ``row_multiple < 1`` or
            ``row_multiple`` without ``drop_zero_advantage``, a ``guide`` with a
            ``sampling`` that has no EOS id.

    Example:
        >>> import optax
        >>> from dew_pipe import Trainer, models
        >>> from dew_pipe.data import encode_text_column
        >>> from dew_pipe.objectives.rl import GRPOObjective
        >>> model = models.build("causal_transformer", vocab_size=8, emb_features=16,
        ...                      num_layers=1, num_heads=2, mlp_features=32, max_seq_len=10)
        >>> objective = GRPOObjective(model, seq_len=5)
        >>> def reward(data_source, completion, ground_truth, extra_info):
        ...     return float(ground_truth in completion.split())
        >>> rollout = SampledRollout(objective, reward, groups=2, max_new_tokens=3,
        ...                          sampling=Sampling(eos_id=2, temperature=1.0))
        >>> prompts = {"prompt": np.array([[0, 3, 4], [5, 6, 7]], np.int32),
        ...            "prompt_length": np.array([2, 3], np.int32),
        ...            "ground_truth": encode_text_column(["1", "5"])}
        >>> state = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0)).initial_state()
        >>> batch = rollout(state, prompts, jax.random.key(1))
        >>> batch["input_ids"].shape   # B * G rows of P + R ids
        (4, 6)
        >>> shared = GRPOObjective(model, seq_len=9)   # a prompt and both completions a row
        >>> rollout = SampledRollout(shared, reward, groups=2, max_new_tokens=3,
        ...                          sampling=Sampling(eos_id=2, temperature=1.0),
        ...                          share_prompts=True)
        >>> rollout(state, prompts, jax.random.key(1))["input_ids"].shape
        (2, 10)
        >>> sorted(rollout.metrics())  # doctest: +NORMALIZE_WHITESPACE
        ['groups/zero_advantage', 'response/length', 'response/truncated', 'reward/mean',
         'reward/positive', 'rows']
    """

    def __init__(
        self,
        objective: Any,
        reward: RewardFunction,
        groups: int,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),  # noqa: B008  # frozen, so one shared default is safe
        decode: Callable[[list[int]], str] | None = None,
        estimator: str = "group",
        *,
        truncation: str = "score",
        pad_id: int = 0,
        drop_zero_advantage: bool = False,
        row_multiple: int | None = None,
        guide: Callable[[str, str, str], Sequence[int] | np.ndarray | None] | None = None,
        share_prompts: bool = False,
        sample_model: Any = None,
    ) -> None:
        model = getattr(objective, "model", None)
        seq_len = getattr(objective, "seq_len", None)
        if model is None or not isinstance(seq_len, int):
            raise TypeError(
                f"objective is a {type(objective).__name__}; expected an objective with a "
                "'model' to sample from and an int 'seq_len' (e.g. GRPOObjective)"
            )
        if sample_model is not None:
            _check_twin(sample_model, model)
            model = sample_model
        if not callable(reward):
            raise TypeError(
                f"reward is {reward!r}; expected reward(data_source, completion, "
                "ground_truth, extra_info) -> float"
            )
        if decode is not None and not callable(decode):
            raise TypeError(f"decode is {decode!r}; expected None or decode(ids) -> str")
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling is {sampling!r}; expected a dew_pipe.sampling.Sampling")
        config = getattr(model, "config", None)
        if getattr(config, "vocab_size", None) is not None:
            sampling.check_vocab(config.vocab_size)
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator is {estimator!r}; expected one of {sorted(ESTIMATORS)}")
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation is {truncation!r}; expected one of {list(TRUNCATIONS)}")
        self.objective = objective
        self.model = model
        self.reward = reward
        self.groups = check_int("groups", groups, minimum=2)
        self.max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
        self.sampling = sampling
        self.decode = join_ids if decode is None else decode
        self.estimator = estimator
        self.truncation = truncation
        self.pad_id = check_int("pad_id", pad_id, minimum=0)
        if not isinstance(drop_zero_advantage, bool):
            raise TypeError(f"drop_zero_advantage is {drop_zero_advantage!r}; expected a bool")
        check_int("row_multiple", row_multiple, minimum=1, allow_none=True)
        if row_multiple is not None and not drop_zero_advantage:
            raise ValueError(
                f"row_multiple is {row_multiple} but drop_zero_advantage is False; every "
                "batch keeps its B * G rows then, so expected row_multiple=None"
            )
        self.drop_zero_advantage = drop_zero_advantage
        self.row_multiple = row_multiple
        if not isinstance(share_prompts, bool):
            raise TypeError(f"share_prompts is {share_prompts!r}; expected a bool")
        self.share_prompts = share_prompts
        if guide is not None:
            if not callable(guide):
                raise TypeError(
                    f"guide is {guide!r}; expected None or guide(data_source, ground_truth, "
                    "extra_info) -> reference ids"
                )
            if sampling.eos_id is None:
                raise ValueError(
                    "guide is set but sampling has no eos_id; a reference reply ends in an "
                    "EOS id, so expected Sampling(eos_id=...)"
                )
            self._log_probs = jax.jit(objective.packed_log_probs)
        self.guide = guide
        self.last_sessions: list[Session] = []
        self._metrics: dict[str, float] = {}

    @property
    def rows_vary(self) -> bool:
        """True with ``drop_zero_advantage``: the Trainer then accepts batches whose row
        count changes (a multiple of ``row_multiple``)."""
        return self.drop_zero_advantage

    # ------------------------------------------------------------------ the hook

    def __call__(self, state: Any, batch: Mapping[str, Any], key: jax.Array) -> dict[str, Any]:
        """Sample, score and pack one prompt batch under ``state.params``.

        Args:
            state: the trainer's `TrainState`; ``params`` samples, ``updates`` stamps
                ``versions``.
            batch: a Prompts batch (``prompt``, ``prompt_length`` and optionally the
                ``data_source``/``ground_truth``/``extra_info`` byte columns, which read as
                empty strings when absent).
            key: the PRNG key of this draw.

        Returns:
            The packed columns, each ``[B * G, P + R]`` (see
            :mod:`dew_pipe.objectives.rl.packing`); with ``drop_zero_advantage``, ``[N, P +
            R]`` with N a multiple of ``row_multiple``. With ``share_prompts`` the rows are
            ``seq_len + 1`` wide and there are ``B * ceil(G / k)`` of them (see the class).

        Raises:
            ValueError: a missing or misshapen field, ``P + R - 1`` different from the
                objective's ``seq_len``, a reward that is not finite (naming the prompt
                index and sample).
            TypeError: a reward that returns a non-number or a decode that returns a
                non-string (naming the prompt index and sample).
            RuntimeError: the reward or decode raised (naming the prompt index and sample;
                the original exception is the cause).
        """
        prompt, lengths, metadata = self._prompts(batch)
        groups, budget = self.groups, self.max_new_tokens
        out = jax.device_get(
            generate(
                self.model,
                state.params,
                prompt,
                lengths,
                budget,
                key,
                self.sampling,
                pad_id=self.pad_id,
                repeats=groups,  # one prefill per prompt, copied to its group's rows
            )
        )
        version = int(state.updates)
        width = prompt.shape[1]
        sessions = []
        for row in range(prompt.shape[0]):
            context = prompt[row, width - int(lengths[row]) :]
            for sample in range(groups):
                n = row * groups + sample
                count, stopped = int(out.lengths[n]), bool(out.stopped[n])
                ids = out.ids[n, :count]
                text = self._decode(ids[:-1] if stopped else ids, row, sample)
                score = self._score(metadata, row, sample, text)
                call = Call(
                    context,
                    ids,
                    out.behavior_log_probs[n, :count],
                    "stop" if stopped else "length",
                    version,
                    log_probs=out.log_probs[n, :count],
                )
                status = Status.COMPLETED if stopped else Status.TRUNCATED
                sessions.append(Session(row, row, sample, 0, [call], status, score))
        sampled, guided = sessions, []
        if self.guide is not None:
            sessions, guided = self._guided(sessions, prompt, lengths, metadata, version)
        full = self._rows(prompt.shape[0], width)
        if self.drop_zero_advantage:
            multiple = self.row_multiple or -(-full // 8)
            rows, shape = None, {"drop_zero_advantage": True, "row_multiple": multiple}
        else:
            rows, shape = full, {}
        packed = pack(
            sessions,
            width=self.objective.seq_len + 1 if self.share_prompts else width + budget,
            rows=rows,
            estimator=self.estimator,
            truncation=self.truncation,
            share_prompts=self.share_prompts,
            **shape,
        )
        if guided:
            # The references were not sampled: give them the policy's own likelihoods.
            scored = np.asarray(self._log_probs(state.params, packed))
            where = np.isin(packed["session_index"], guided) & (packed["response_mask"] == 1)
            packed["behavior_log_probs"][where] = scored[where]
            packed["old_log_probs"][where] = scored[where]
        if self.drop_zero_advantage:
            packed["advantages"] *= self._kept_share(sessions, packed)
        self.last_sessions = sessions
        self._metrics = _summary(sampled, groups, packed["advantages"], packed["session_index"])
        if self.guide is not None:
            self._metrics["groups/guided"] = len(guided) / prompt.shape[0]
        return packed

    def _guided(
        self,
        sessions: list[Session],
        prompt: np.ndarray,
        lengths: np.ndarray,
        metadata: dict[str, list[str]],
        version: int,
    ) -> tuple[list[Session], list[int]]:
        """``sessions`` with each collapsed group's last completion (all G the same reply)
        replaced by the guide's reference where the reward scores it higher; and the
        replaced sessions' indices."""
        groups, width = self.groups, prompt.shape[1]
        out, guided = list(sessions), []
        for row in range(prompt.shape[0]):
            group = sessions[row * groups : (row + 1) * groups]
            rewards = {s.reward for s in group if trains(s, self.truncation)}
            if len(rewards) > 1:
                continue  # mixed: the group has its own signal
            if len({s.calls[0].sampled_ids.tobytes() for s in group}) > 1:
                continue  # still exploring: sampling may yet find a better reply
            ids = self._reference(metadata, row)
            if ids is None:
                continue
            text = self._decode(ids[:-1], row, groups - 1)
            score = self._score(metadata, row, groups - 1, text)
            if rewards and score <= max(rewards):
                continue  # the reference does no better than what was sampled
            zeros = np.zeros(ids.size, np.float32)  # set from a scoring pass after packing
            call = Call(
                prompt[row, width - int(lengths[row]) :],
                ids,
                zeros,
                "stop",
                version,
                log_probs=zeros,
            )
            index = row * groups + groups - 1
            out[index] = Session(row, row, groups - 1, 0, [call], Status.COMPLETED, score)
            guided.append(index)
        return out, guided

    def _reference(self, metadata: dict[str, list[str]], row: int) -> np.ndarray | None:
        """The guide's reference ids for prompt ``row``, checked; None where it has none."""
        source, truth, extra = (metadata[name][row] for name in _METADATA)
        try:
            ids = self.guide(source, truth, extra)
        except Exception as error:
            raise RuntimeError(f"guide raised on prompt {row}: {error!r}") from error
        if ids is None:
            return None
        array = np.asarray(ids)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise TypeError(
                f"guide returned {array.dtype} with shape {array.shape} on prompt {row}; "
                "expected 1-D integer token ids or None"
            )
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if not 1 <= array.size <= self.max_new_tokens:
            raise ValueError(
                f"guide returned {array.size} ids on prompt {row}; expected 1 to "
                f"max_new_tokens={self.max_new_tokens}, ending in EOS"
            )
        if array.min() < 0 or (vocab is not None and array.max() >= vocab):
            raise ValueError(
                f"guide returned ids in [{array.min()}, {array.max()}] on prompt {row}; "
                f"expected ids in [0, {vocab})"
            )
        eos = self.sampling.eos_ids
        if int(array[-1]) not in eos or np.isin(array[:-1], eos).any():
            raise ValueError(
                f"guide returned {array.tolist()} on prompt {row}; expected a reply that ends "
                f"in its only EOS id (one of {list(eos)})"
            )
        return array.astype(np.int32)

    def metrics(self) -> dict[str, float]:
        """Numbers about the last call's completions, for logging.

        ``reward/mean``, ``reward/positive`` (share of completions whose reward is above
        0), ``response/length`` (mean sampled ids, EOS included),
        ``response/truncated`` (share that ran out of budget), ``groups/zero_advantage``
        (share of prompts none of whose completions has a nonzero advantage in the batch:
        they train nothing, and ``drop_zero_advantage`` leaves them out) and ``rows`` (the
        packed batch's rows); with a ``guide``, ``groups/guided`` (share of prompts whose
        last completion was replaced by the reference). The rewards are the sampled
        completions'. Empty before the first call.
        """
        return dict(self._metrics)

    # ------------------------------------------------------------------ helpers

    def _rows(self, prompts: int, width: int) -> int:
        """Rows that hold every completion of ``prompts`` prompts ``width`` ids wide when
        each is full length: one per completion, or with shared prompts one per block of
        the completions that fit beside one copy of the prompt."""
        if not self.share_prompts:
            return prompts * self.groups
        room = self.objective.seq_len + 1 - (width - 1)  # beside a full prompt's shared ids
        fits = room // (self.max_new_tokens + 1)
        return prompts * -(-self.groups // fits)

    def _kept_share(self, sessions: Sequence[Session], packed: Mapping[str, np.ndarray]):
        """What the policy loss averages over in ``packed``, as a share of the same for
        every completion that trains: its sampled tokens ("token-mean") or completions
        ("session-mean"). 1 when nothing was kept."""
        trained = [s for s in sessions if trains(s, self.truncation)]
        options = getattr(self.objective, "options", None)
        sampled = packed["response_mask"] == 1
        if getattr(options, "aggregation", "token-mean") == "session-mean":
            kept = np.unique(packed["session_index"][sampled]).size
            full = sum(1 for s in trained if s.calls[0].sampled_ids.size)
        else:
            kept = int(sampled.sum())
            full = sum(s.calls[0].sampled_ids.size for s in trained)
        return np.float32(kept / full) if kept else np.float32(1.0)

    def _prompts(
        self, batch: Mapping[str, Any]
    ) -> tuple[np.ndarray, np.ndarray, dict[str, list[str]]]:
        if not isinstance(batch, Mapping):
            raise TypeError(f"batch is a {type(batch).__name__}; expected a mapping of arrays")
        prompt = _integers(batch, "prompt", 2)
        lengths = _integers(batch, "prompt_length", 1)
        rows, width = prompt.shape
        if rows < 1 or width < 1:
            raise ValueError(f"batch field 'prompt' has shape {prompt.shape}; expected [B, P] >= 1")
        if lengths.shape != (rows,):
            raise ValueError(
                f"batch field 'prompt_length' has shape {lengths.shape}; expected [{rows}]"
            )
        if lengths.min() < 1 or lengths.max() > width:
            bad = int(np.flatnonzero((lengths < 1) | (lengths > width))[0])
            raise ValueError(
                f"batch field 'prompt_length' is {int(lengths[bad])} in row {bad}; expected a "
                f"length in [1, {width}]"
            )
        seq_len = self.objective.seq_len
        if self.share_prompts and width + self.max_new_tokens - 1 > seq_len:
            raise ValueError(
                f"batch field 'prompt' is {width} ids wide and max_new_tokens is "
                f"{self.max_new_tokens}, so a completion takes up to "
                f"{width + self.max_new_tokens} ids, but the objective's seq_len is {seq_len}; "
                f"with share_prompts expected seq_len >= P + R - 1 = "
                f"{width + self.max_new_tokens - 1}"
            )
        if not self.share_prompts and width + self.max_new_tokens - 1 != seq_len:
            raise ValueError(
                f"batch field 'prompt' is {width} ids wide and max_new_tokens is "
                f"{self.max_new_tokens}, so packed rows hold {width + self.max_new_tokens} ids, "
                f"but the objective's seq_len is {seq_len}; expected seq_len = P + R - 1 = "
                f"{width + self.max_new_tokens - 1}"
            )
        metadata = {}
        for name in _METADATA:
            if name not in batch:
                metadata[name] = [""] * rows
                continue
            column = np.asarray(batch[name])
            if column.ndim != 2 or column.shape[0] != rows:
                raise ValueError(
                    f"batch field {name!r} has shape {column.shape}; expected [{rows}, M] "
                    "UTF-8 bytes"
                )
            metadata[name] = decode_text_column(column, field=name)
        return prompt.astype(np.int32, copy=False), lengths.astype(np.int32), metadata

    def _decode(self, ids: np.ndarray, row: int, sample: int) -> str:
        try:
            text = self.decode([int(i) for i in ids])
        except Exception as error:
            raise RuntimeError(
                f"decode raised on prompt {row}, sample {sample} (ids {ids.tolist()}): {error!r}"
            ) from error
        if not isinstance(text, str):
            raise TypeError(
                f"decode returned {type(text).__name__} {text!r} on prompt {row}, sample "
                f"{sample}; expected a str"
            )
        return text

    def _score(self, metadata: dict[str, list[str]], row: int, sample: int, text: str) -> float:
        source, truth, extra = (metadata[name][row] for name in _METADATA)
        try:
            value = self.reward(source, text, truth, extra)
        except Exception as error:
            raise RuntimeError(
                f"reward raised on prompt {row}, sample {sample} (completion {text!r}): {error!r}"
            ) from error
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            raise TypeError(
                f"reward returned {type(value).__name__} {value!r} on prompt {row}, sample "
                f"{sample}; expected a finite float"
            )
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(
                f"reward returned {value} on prompt {row}, sample {sample} (completion "
                f"{text!r}); expected a finite float"
            )
        return value


def _summary(
    sessions: Sequence[Session], groups: int, advantages: np.ndarray, session_index: np.ndarray
) -> dict[str, float]:
    rewards = np.array([s.reward for s in sessions], np.float64)
    lengths = np.array([s.calls[0].sampled_ids.size for s in sessions], np.float64)
    truncated = np.array([s.status is Status.TRUNCATED for s in sessions], np.float64)
    sampled = session_index >= 0
    moving = session_index[sampled][advantages[sampled] != 0]
    informative = np.zeros(len(sessions) // groups, bool)
    informative[moving // groups] = True  # sessions are prompt-major: prompt * G + sample
    return {
        "reward/mean": float(rewards.mean()),
        "reward/positive": float((rewards > 0).mean()),
        "response/length": float(lengths.mean()),
        "response/truncated": float(truncated.mean()),
        "groups/zero_advantage": float(1.0 - informative.mean()),
        "rows": float(session_index.shape[0]),
    }


def _check_twin(sample_model: Any, model: Any) -> None:
    """Refuses a ``sample_model`` that is not ``model`` in another compute dtype."""
    twin, own = getattr(sample_model, "config", None), getattr(model, "config", None)
    if type(sample_model) is not type(model) or type(twin) is not type(own):
        raise TypeError(
            f"sample_model is a {type(sample_model).__name__}; expected a "
            f"{type(model).__name__} like the objective's model"
        )
    if dataclasses.is_dataclass(own) and dataclasses.replace(twin, dtype=own.dtype) != own:
        fields = [
            f.name
            for f in dataclasses.fields(own)
            if f.name != "dtype" and getattr(twin, f.name) != getattr(own, f.name)
        ]
        shown = ", ".join(
            f"{name}={getattr(twin, name)!r} (the objective's model: {getattr(own, name)!r})"
            for name in fields
        )
        raise ValueError(
            f"sample_model's config differs from the objective model's in {shown}; expected "
            "the same model in another compute dtype"
        )
