"""dew-pipe run's per-machine disk cache of compiled programs (dew_pipe.compile_cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dew_pipe import compile_cache
from dew_pipe.inference.servers import engine_setup

ROOT = Path(__file__).resolve().parents[1]

# A pipeline file whose job compiles one program and prints what JAX's cache reported.
PIPELINE = """
import json
import jax
import jax.numpy as jnp
from jax import monitoring

events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))


class Job:
    def run(self, context):
        value = jax.jit(lambda x: jnp.tanh(x * 3.0) @ x.T)(jnp.ones((4, 4)))
        print("EVENTS", json.dumps({
            "hits": events.count("/jax/compilation_cache/cache_hits"),
            "misses": events.count("/jax/compilation_cache/cache_misses"),
            "dir": jax.config.jax_compilation_cache_dir,
            "value": float(value.sum()),
        }))


def main():
    return Job()
"""


def _run(tmp_path: Path, *options: str, env: dict[str, str] | None = None) -> dict:
    script = tmp_path / "compiles.py"
    script.write_text(PIPELINE)
    command = [sys.executable, "-m", "dew_pipe.cli", "run", str(script), *options]
    command += ["--run-dir", str(tmp_path / f"run{len(list(tmp_path.glob('run*')))}")]
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("JAX_COMPILATION_CACHE") and k != "DEW_PIPE_COMPILE_CACHE"
    }
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, cwd=ROOT, env={**base, **(env or {})}
    )
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("EVENTS "))
    return json.loads(line.removeprefix("EVENTS "))


def _files(directory: Path) -> set[str]:
    return {p.name for p in directory.rglob("*") if p.is_file()}


def test_a_second_run_finds_its_programs_in_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = _run(tmp_path, "--compile-cache", str(cache))
    where = cache / compile_cache.machine_key()
    assert first["dir"] == str(where) and first["hits"] == 0 and first["misses"] >= 1
    stored = _files(where)
    assert stored  # the compiled program, written under the machine's subdirectory
    second = _run(tmp_path, "--compile-cache", str(cache))
    assert second["hits"] >= 1 and second["misses"] == 0
    assert second["value"] == first["value"] and _files(where) == stored


def test_the_default_root_the_variable_off_and_a_users_own_jax_cache(tmp_path):
    home = tmp_path / "xdg"
    env = {"XDG_CACHE_HOME": str(home)}
    key = compile_cache.machine_key()
    assert _run(tmp_path, env={**env, "DEW_PIPE_COMPILE_CACHE": "off"})["dir"] in ("", None)
    assert _run(tmp_path, "--compile-cache", "off", env=env)["dir"] in ("", None)
    assert not home.exists()  # off writes nothing
    mine = _run(tmp_path, env={**env, "DEW_PIPE_COMPILE_CACHE": str(tmp_path / "mine")})
    assert mine["dir"] == str(tmp_path / "mine" / key) and not home.exists()
    default = _run(tmp_path, env=env)
    assert default["dir"] == str(home / "dew_pipe" / "xla" / key)
    assert _files(home / "dew_pipe" / "xla" / key)
    own = _run(tmp_path, "--compile-cache", str(tmp_path / "ignored"),
               env={**env, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax")})  # fmt: skip
    assert own["dir"] == str(tmp_path / "jax") and not (tmp_path / "ignored").exists()


def test_an_empty_setting_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DEW_PIPE_COMPILE_CACHE", " ")
    with pytest.raises(ValueError, match="DEW_PIPE_COMPILE_CACHE is ' '; expected a directory"):
        compile_cache.resolve()
    with pytest.raises(ValueError, match="compile cache is ''; expected a directory or 'off'"):
        compile_cache.resolve("")


def test_resolve_reads_the_option_then_the_variable_then_the_default(tmp_path, monkeypatch):
    key = compile_cache.machine_key()
    monkeypatch.delenv("DEW_PIPE_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve() == tmp_path / "xdg" / "dew_pipe" / "xla" / key
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    home = Path(os.path.expanduser("~"))
    assert compile_cache.resolve() == home / ".cache" / "dew_pipe" / "xla" / key
    monkeypatch.setenv("DEW_PIPE_COMPILE_CACHE", str(tmp_path / "env"))
    assert compile_cache.resolve() == tmp_path / "env" / key
    assert compile_cache.resolve(tmp_path / "arg") == tmp_path / "arg" / key
    assert compile_cache.resolve("off") is None
    monkeypatch.setenv("DEW_PIPE_COMPILE_CACHE", "off")
    assert compile_cache.resolve() is None


def test_the_machine_key_follows_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(engine_setup, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    avx2 = compile_cache.machine_key()
    monkeypatch.setattr(engine_setup, "cpu_flags", lambda: frozenset({"fma", "avx2"}))
    assert compile_cache.machine_key() == avx2  # the order of the flags does not matter
    monkeypatch.setattr(
        engine_setup, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})
    )
    assert compile_cache.machine_key() != avx2


def test_an_empty_variable_exits_2_naming_it(tmp_path):
    script = tmp_path / "compiles.py"
    script.write_text(PIPELINE)
    done = subprocess.run(
        [sys.executable, "-m", "dew_pipe.cli", "run", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "DEW_PIPE_COMPILE_CACHE": ""},
    )
    assert done.returncode == 2
    assert "DEW_PIPE_COMPILE_CACHE is ''; expected a directory or 'off'" in done.stderr


def test_a_directory_that_cannot_be_made_exits_2_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    script = tmp_path / "compiles.py"
    script.write_text(PIPELINE)
    done = subprocess.run(
        [sys.executable, "-m", "dew_pipe.cli", "run", str(script), "--compile-cache", str(blocker)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert f"compile cache {blocker / compile_cache.machine_key()}: cannot create it" in done.stderr
