#!/usr/bin/env bash
# Builds (or reuses) the two environments the gateway and Harbor tests run real components
# from, each isolated from the project's .venv (dew_pipe only talks HTTP to the gateway and
# starts Harbor as a separate process):
#
#   .gateway-venv   rllm-model-gateway 0.1.0 (pure Python: FastAPI, uvicorn, httpx), made
#                   from python3
#   .harbor-venv    harbor 0.25.0, which needs Python >= 3.12: made from PYTHON312, else
#                   python3.12 on PATH, else pyenv's newest 3.12; skipped (with a line saying
#                   so) when none is found, and the Harbor tests then skip saying why
#
# Usage, from the repository root:  benchmarks/agent_envs.sh
#
# Idempotent: an environment whose marker file names this script's pin and whose
# interpreter imports the package is reused as it is. About 10 s for the gateway and a
# minute for Harbor on a fresh machine (PyPI wheels only; nothing is built). Both folders
# are git-ignored.
set -euo pipefail

build() {  # build DIR PYTHON PIN MODULE
    local dir="$1" python="$2" pin="$3" module="$4" marker="$1/.dew-pipe-env"
    if [[ -f "$marker" && "$(cat "$marker")" == "$pin" ]] \
        && "$dir/bin/python" -c "import $module" 2>/dev/null; then
        echo "agent envs: reusing $dir ($pin)"
        return
    fi
    rm -rf "$dir"
    "$python" -m venv "$dir"
    "$dir/bin/python" -m pip install --quiet "$pin"
    "$dir/bin/python" -c "import $module"
    echo "$pin" >"$marker"
    echo "agent envs: built $dir ($pin)"
}

build .gateway-venv python3 "rllm-model-gateway==0.1.0" rllm_model_gateway

is312() { [[ -n "$1" ]] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
python312=""
for candidate in "${PYTHON312:-}" "$(command -v python3.12 || true)" \
    $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python 2>/dev/null | sort -rV); do
    if is312 "$candidate"; then python312="$candidate"; break; fi
done
if [[ -n "$python312" ]]; then
    build .harbor-venv "$python312" "harbor==0.25.0" harbor
else
    echo "agent envs: no Python 3.12 found (set PYTHON312); Harbor tests will skip"
fi
