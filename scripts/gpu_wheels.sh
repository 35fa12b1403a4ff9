#!/usr/bin/env bash
# The wheels bench/gpu_check.py needs on a lent GPU machine (no network there), into build/gpu-wheels/ (ignored),
# with their total size: the device call carries that folder, and it travels with the working tree, 64 MiB in all.
#
#   bash scripts/gpu_wheels.sh                                    # for that machine's Python 3.12
#   GPU_PYTHON=3.11 bash scripts/gpu_wheels.sh build/wheels-311   # another Python, another folder
#
# That machine's image has torch, transformers, accelerate and peft, and beside them pandas, pyarrow, xxhash,
# psutil, pyyaml, matplotlib, scipy, pytest and hypothesis. It lacks datasets (with dill and multiprocess), and
# speculators 0.9.0 with what its Eagle3DraftModel imports: hs-connectors, loguru, openai (with httpx2, httpcore2,
# truststore and sniffio) and pydantic (with pydantic-core, annotated-types and typing-inspection). The versions are
# those scripts/setup.sh's environment runs the tests with; every wheel goes in with --no-deps, as speculators goes
# in here. specdec itself goes in as the carried tree, installed editable (the code checked is the tree's, never a
# stale build), with the setuptools that builds it here: tests/test_cuda.py's subprocesses put the checkout first on
# PYTHONPATH, where the bare specdec/ folder would hide an installed wheel's specdec.train and specdec.eval.
# The device call runs, from the repository's root (docs/usage.md, "Checking on a GPU"):
#
#   python3 -m pip install -q --no-index --no-deps build/gpu-wheels/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --minutes 8 --out "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/gpu-wheels}"
python_version="${GPU_PYTHON:-3.12}"
py="${PYTHON:-.venv/bin/python}"
limit=$((64 * 1024 * 1024))

rm -rf "$out"
mkdir -p "$out"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$out" \
    "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19" \
    "speculators==0.9.0" "hs-connectors==0.9.0" "loguru==0.7.3" \
    "openai==3.57.0" "httpx2==2.16.2" "httpcore2==2.16.2" "truststore==0.10.5" "sniffio==1.3.1" \
    "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5" \
    "setuptools==84.2.1"

# The commit of the tree: the copy on that machine has no .git to ask.
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    commit="$commit (with uncommitted changes)"
fi
echo "$commit" >"$out/commit.txt"

size=$(du -sb "$out" | cut -f1)
echo "$(ls "$out"/*.whl | wc -l) wheels in $out: $((size / 1024)) KiB (the limit for the tree and what it carries: 64 MiB)"
if [ "$size" -ge "$limit" ]; then
    echo "gpu_wheels.sh: error: $out is over 64 MiB: leave out what the device machine has" >&2
    exit 1
fi
