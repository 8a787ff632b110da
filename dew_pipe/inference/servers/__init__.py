"""Rollout servers: token ids in, a future `Draw` out, weights pushed by version.

A rollout server is what a session source (`dew_pipe.inference.PromptSource`) samples
from. Every backend answers the `RolloutServer` requests (``submit``, ``load``,
``close``); the files say which part of which backend they hold:

``interface.py``
    `RolloutServer` (the protocol every backend follows) and `Draw` (what one request
    returns: sampled ids, behavior and raw likelihoods, versions).
``engine.py``
    `Server`, dew_pipe's continuous-batching engine: rows of decoder cache served by one
    background thread, requests joining a running batch, weight reloads between steps.
``engine_steps.py``
    The engine's compiled functions: join rows (``prefill``: ``encode`` the distinct
    prompts, ``place`` their caches in rows, ``begin`` the draws), advance rows
    (``advance``), write new weights in place (``copy_into``).
``engine_setup.py``, ``engine_records.py``
    What the engine is built from (`ServeTask`, option checks, served precision) and what
    its thread keeps (requests, reloads, `ServerCounters`).
``native.py``
    `NativeRolloutServer`: the interface over an in-process `Server`.
``process.py``, ``process_worker.py``
    `ProcessRolloutServer`: the same `Server` in a child process with its own XLA runtime
    (the parent side), and the child that runs it (``python -m`` this module).

``http_json.py``
    `JSONClient`: JSON over HTTP (standard library) with a deadline on every request, and
    `EngineError`, what every engine failure raises.
``remote.py``
    `RemoteServer`: what the HTTP backends share (futures, seeds, cancellation, pushes).
``openai_completions.py``
    `OpenAICompletion` (a vLLM or SGLang completions route, token ids in and out) and
    `OpenAIRolloutServer` over it.
``vllm_generate.py``
    `VLLMGenerateServer`: vLLM's token route, with supports and per-span weight versions.
``publication.py``
    `SafetensorsReload` (a push through the checkpoint directory and each engine's reload
    endpoints) and `Publication` (a versioned publisher over any push).
``nccl.py``, ``nccl_push.py``
    NCCL through ctypes (no torch), and `NCCLPush`: a push into vLLM replicas' GPUs by
    NCCL broadcast.

The public names
are exported lazily by `dew_pipe.inference` (``from dew_pipe.inference import Server``);
this package's ``__init__`` imports nothing, so starting the child process stays cheap.
"""
