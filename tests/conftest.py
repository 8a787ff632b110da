"""Shared pytest fixtures. Keep each one small and session-scoped where it builds something."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# `dew-pipe run` keeps compiled programs in ~/.cache by default; the suite's runs (in this
# process and the ones it starts) leave no files there. tests/test_compile_cache.py turns
# the cache on where it tests it.
os.environ["DEW_PIPE_COMPILE_CACHE"] = "off"

# Files that share the session's vLLM engine (the `vllm_engine` fixture below) run on one
# pytest-xdist worker, so the suite starts one engine, not one per worker.
VLLM_FILES = frozenset(
    {
        "test_engine_push.py",
        "test_gateway.py",
        "test_grpo_vllm_pipeline.py",
        "test_harbor.py",
        "test_vllm_engine.py",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` (the README's test command), keep each file on one
    worker, so its module fixtures and compiles are built once, and the vLLM files together.
    Without xdist the marks are inert."""
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("vllm" if name in VLLM_FILES else name))


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
