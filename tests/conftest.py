"""Shared pytest fixtures. Keep each one small and session-scoped where it builds something."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def story_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the project's story tokenizer (BPE + chat template), trained once (~0.5 s).

    Load it with ``transformers.AutoTokenizer.from_pretrained(story_tokenizer_dir)`` or pass the
    path wherever a tokenizer name is accepted.
    """
    from dew_pipe.data.stories import story_tokenizer

    directory = tmp_path_factory.mktemp("story_tokenizer")
    story_tokenizer(directory=directory)
    return directory


@pytest.fixture(scope="session")
def story_tokenizer(story_tokenizer_dir: Path):
    """The story tokenizer, reloaded from :func:`story_tokenizer_dir` with AutoTokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(story_tokenizer_dir)


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory):
    """A real vLLM server on loopback, started once per session (see tests/vllm_helpers.py).

    Skips without a vLLM interpreter (``benchmarks/vllm_env.sh`` builds one), except under
    CI (``CI`` set), where the missing engine fails the test instead.
    """
    import os

    from vllm_helpers import start_engine, vllm_python

    if vllm_python() is None:
        message = "no vLLM interpreter: run benchmarks/vllm_env.sh (or set DEW_PIPE_VLLM_PYTHON)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    engine = start_engine(tmp_path_factory.mktemp("vllm"))
    yield engine
    engine.stop()
