"""Harbor plugins for the HarborSource test: a bubblewrap environment and a one-call agent.

Harbor (0.25.0) imports these by path (``-e dew_harbor_plugins:BubblewrapEnvironment``,
``--agent dew_harbor_plugins:ChatOnceAgent``) in its own Python >= 3.12 environment, with
this folder on PYTHONPATH; dew_pipe never imports them.

* `BubblewrapEnvironment`: Harbor ships no local environment, so this one runs every command
  of a trial in bubblewrap, without network (``--unshare-all``): a tmpfs root with the host's
  /usr and /etc read-only, and the trial's own writable /app, /logs, /tests, /solution and
  /tmp backed by one host folder that ``stop`` removes. It supports ``network_mode =
  "no-network"`` only; it refuses an allowlist rather than pretend to enforce one.
* `ChatOnceAgent`: a host-side agent (Harbor runs it in its own process, as it runs
  terminus-2): one chat completion at the trial's ``base_url`` with the task instruction,
  the answer written to /app/answer.txt inside the sandbox. The sandbox itself never reaches
  the model.
"""

import asyncio
import json
import os
import shlex
import shutil
import signal
import tempfile
import urllib.request
from pathlib import Path, PurePosixPath

from harbor.agents.agent_auth_resolution import ModelConnectionSpec
from harbor.agents.base import BaseAgent
from harbor.agents.capabilities import AgentCapabilities
from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.model_api_format import ModelApiFormat

_WRITABLE = ("app", "logs", "tests", "solution", "tmp", "root")
_READ_ONLY = ("usr", "etc", "opt")


def _bwrap() -> str:
    found = os.environ.get("DEW_HARBOR_BWRAP") or shutil.which("bwrap")
    if not found:
        raise RuntimeError("bubblewrap: set DEW_HARBOR_BWRAP or put bwrap on PATH")
    return found


class BubblewrapEnvironment(BaseEnvironment):
    """Each exec in a fresh bubblewrap sandbox over the trial's own host folder."""

    @staticmethod
    def type() -> str:
        return "dew-bubblewrap"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self):
        return None

    async def start(self, force_build: bool) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="dew-harbor-"))
        for name in _WRITABLE:
            (self._root / name).mkdir()
        for name in ("agent", "verifier", "artifacts"):
            (self._root / "logs" / name).mkdir()

    async def stop(self, delete: bool):
        root = getattr(self, "_root", None)
        if root is not None and delete:
            shutil.rmtree(root, ignore_errors=True)

    def _host(self, path) -> Path:
        """The host path behind a sandbox path (only the writable folders have one)."""
        posix = PurePosixPath(str(path))
        if not posix.is_absolute():
            posix = PurePosixPath("/app") / posix
        parts = posix.parts[1:]
        if not parts or parts[0] not in _WRITABLE or ".." in parts:
            raise ValueError(f"{path}: not under a writable sandbox folder {_WRITABLE}")
        return self._root.joinpath(*parts)

    async def upload_file(self, source_path, target_path):
        target = self._host(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_path, target)

    async def upload_dir(self, source_dir, target_dir):
        shutil.copytree(source_dir, self._host(target_dir), dirs_exist_ok=True)

    async def download_file(self, source_path, target_path):
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self._host(source_path), target_path)

    async def download_dir(self, source_dir, target_dir):
        shutil.copytree(self._host(source_dir), target_dir, dirs_exist_ok=True)

    def _command(self, command, cwd, env):
        argv = [_bwrap(), "--unshare-all", "--die-with-parent", "--new-session"]
        for name in _READ_ONLY:
            if os.path.isdir(f"/{name}"):
                argv += ["--ro-bind", f"/{name}", f"/{name}"]
        for name in ("bin", "sbin", "lib", "lib64"):
            link = f"/{name}"
            if os.path.islink(link):
                argv += ["--symlink", os.readlink(link), link]
            elif os.path.isdir(link):
                argv += ["--ro-bind", link, link]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        for name in _WRITABLE:
            argv += ["--bind", str(self._root / name), f"/{name}"]
        argv += ["--chdir", cwd or self.task_env_config.workdir or "/app", "--clearenv"]
        variables = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
        variables.update(self._persistent_env)
        variables.update(env or {})
        for key, value in variables.items():
            argv += ["--setenv", key, value]
        return argv + ["--", "/bin/bash", "-c", command]

    async def exec(self, command, cwd=None, env=None, timeout_sec=None, user=None):
        process = await asyncio.create_subprocess_exec(
            *self._command(command, cwd, env),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout_sec)
        except (TimeoutError, asyncio.CancelledError):
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            raise
        return ExecResult(
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            return_code=process.returncode,
        )


class ChatOnceAgent(BaseAgent):
    """One chat completion with the instruction; the reply goes to /app/answer.txt."""

    MODEL_CONNECTION = ModelConnectionSpec(
        base_url_destination_names={"default": None},
        supported_api_formats=[ModelApiFormat.OPENAI_CHAT_COMPLETIONS],
    )
    capabilities = AgentCapabilities(base_url=True)

    @staticmethod
    def name() -> str:
        return "dew-chat-once"

    def version(self) -> str:
        return "1.0.0"

    async def setup(self, environment) -> None:
        return None

    def _complete(self, instruction: str) -> dict:
        body = {
            "model": self.model_name,
            "messages": [{"role": "user", "content": instruction}],
            "max_tokens": int(os.environ.get("DEW_HARBOR_MAX_TOKENS", "6")),
            "temperature": 1.0,
            "seed": 0,
        }
        request = urllib.request.Request(
            self._base_url.rstrip("/") + "/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            return json.loads(answer.read())

    async def run(self, instruction, environment, context) -> None:
        reply = await asyncio.to_thread(self._complete, instruction)
        text = reply["choices"][0]["message"].get("content") or ""
        quoted = shlex.quote(text)
        result = await environment.exec(f"printf %s {quoted} > /app/answer.txt", timeout_sec=60)
        if result.return_code != 0:
            raise RuntimeError(f"writing the answer failed: {result.stderr}")
        usage = reply.get("usage") or {}
        context.n_input_tokens = usage.get("prompt_tokens")
        context.n_output_tokens = usage.get("completion_tokens")
