#!/usr/bin/env bash
# Builds the reference environment: the isolated interpreter with PyTorch, transformers, TRL
# and verl that the torch sides of benchmarks/{dpo_step,generate,train_step}.py and the
# recording scripts under tests/parity/ run in. dew_pipe itself never imports any of them,
# so they stay out of the project's own .venv.
#
# Usage, from the repository root:
#
#     benchmarks/reference_env.sh [DIR]      # DIR defaults to .reference-venv (git-ignored)
#
# The benchmarks find DIR/bin/python by themselves when DIR is .reference-venv; for another
# DIR pass --reference-python DIR/bin/python or export DEW_PIPE_REFERENCE_PYTHON (the last
# line printed says what to export). PYTHON picks the interpreter the venv is made from
# (default python3; the pins below were recorded with Python 3.11).
#
# The versions are the ones the committed fixtures and RESULTS.md figures came from
# (tests/parity/fixtures/*: torch 2.13.0+cpu, transformers 5.24.0, tokenizers 0.23.3,
# TRL 1.16.0, verl 0.9.1). torch is pinned in a constraints file for every step: an
# unpinned torch pulled in by another package would fetch a CUDA build of several GB,
# and the CPU build is what the figures were measured with. verl is installed without its
# dependencies (they include GPU-only packages); the modules its import needs are listed
# after it.
set -euo pipefail

dir="${1:-.reference-venv}"
python="${PYTHON:-python3}"

"$python" -m venv "$dir"
pip=("$dir/bin/python" -m pip install --quiet)
constraints="$dir/constraints.txt"
echo "torch==2.13.0" >"$constraints"

"${pip[@]}" --upgrade pip
"${pip[@]}" -c "$constraints" torch==2.13.0
"${pip[@]}" -c "$constraints" \
    transformers==5.24.0 tokenizers==0.23.3 trl==1.16.0 datasets safetensors numpy
"${pip[@]}" -c "$constraints" --no-deps verl==0.9.1
"${pip[@]}" -c "$constraints" ray tensordict omegaconf codetiming orjson
# verl's agent loop (tests/parity/record_verl_interop.py) imports these as well
"${pip[@]}" -c "$constraints" hydra-core pillow cachetools uvicorn fastapi

"$dir/bin/python" -c "import torch, transformers, trl, verl; print('reference env:', \
torch.__version__, transformers.__version__, trl.__version__, verl.__version__)"
echo "export DEW_PIPE_REFERENCE_PYTHON=$(cd "$dir" && pwd)/bin/python"
