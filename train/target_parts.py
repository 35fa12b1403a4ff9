"""The target's parts a run with recorded states reads, loaded alone: what makes a 70B-class target trainable on
one device per process.

A draft that reads the target's hidden states (EAGLE-3, P-EAGLE, DFlash) needs the target's forward only to
compute those states. When the data stage recorded them (`states: recorded`, or `auto` with every data folder
recorded), the loop reads nothing of the target but its input embedding (the draft's frozen copy, its vocabulary
size), its final norm (the draft's copy) and its head (the draft's head rows and the online teacher's rows, applied
to the recorded final state), plus its last decoder layer where `layer_init: target` starts the draft's layer as
a copy of it. `load_target_parts` reads just those tensors from the checkpoint's safetensors files (only the
shards that hold them, through the index of a sharded checkpoint) into `TargetParts`, which answers the target's
interface for them (`config`, `get_input_embeddings`, `get_output_embeddings`, `get_decoder().norm` / `.layers`)
and refuses a forward. The embedded target (135M) loads whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from specdec.models import check_checkpoint, is_embedded, resolve_device, resolve_dtype
from specdec.train.batches import data_folders
from specdec.train.eagle3_states import recorded_layer_ids

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
WHY = ("only the target's embedding, final norm and head are loaded (its states are recorded: states=recorded, "
       "or states=auto with every data folder recorded)")


def loads_parts_only(cfg) -> bool:
    """Whether the trainer loads only the target's parts (module docstring): the draft kind reads the target's
    states, no teacher needs the target's forward, and the states are recorded."""
    if not cfg.kind.facts.reads_target_states or is_embedded(cfg.target) or cfg.teacher not in ("online", "offline"):
        return False
    states = cfg.options.states
    return states == "recorded" or (states == "auto" and every_folder_recorded(cfg))


def every_folder_recorded(cfg) -> bool:
    """Whether every data folder of the run (training and held-out) recorded the target's states."""
    try:
        train_paths, heldout_path = data_folders(cfg)
        folders = train_paths + ([heldout_path] if heldout_path else [])
        return bool(folders) and all(recorded_layer_ids(f) is not None for f in folders)
    except (ValueError, OSError, KeyError):  # no data yet: the plan of a run to come
        return False


def reads_last_layer(cfg) -> bool:
    """`layer_init: target` starts the draft's layer as a copy of the target's last decoder layer."""
    return getattr(cfg.options, "layer_init", "random") == "target"


def recordings_differ(cfg, folders, draft) -> bool:
    """states=auto only: some folder recorded other layers than `draft` reads, so those states are computed online
    and the run needs the whole target after all (train/eagle3_states.py falls back to the target there)."""
    wanted = list(getattr(draft, "layer_ids", []))
    return cfg.options.states == "auto" and any(recorded_layer_ids(f) != wanted for f in folders)


# ---- the parts as a module ---------------------------------------------------------------------------------
class NotLoaded(nn.Module):
    """A decoder layer of the target that was not loaded: any use says so."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise ValueError(f"the target's layer {self.index} is not loaded: {WHY}; set states=online for a run that "
                         "runs the target")

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "index":
            return super().__getattr__(name)
        raise AttributeError(f"the target's layer {self.index} is not loaded ({WHY}), so it has no {name!r}")


class PartsDecoder(nn.Module):
    """The decoder's loaded parts: its embedding, final norm and layers (`NotLoaded` where not loaded)."""

    def __init__(self, embed_tokens: nn.Module, norm: nn.Module, layers: nn.ModuleList):
        super().__init__()
        self.embed_tokens, self.norm, self.layers = embed_tokens, norm, layers

    def forward(self, *args, **kwargs):
        raise ValueError(f"the target cannot run: {WHY}; set states=online, or regenerate the data with "
                         "record_features=true and this recipe's layers")


class TargetParts(nn.Module):
    """The target as far as a run with recorded states reads it, with the causal LM's interface for those parts."""

    def __init__(self, config, decoder: PartsDecoder, lm_head: nn.Module):
        super().__init__()
        self.config, self.model, self.lm_head = config, decoder, lm_head

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_decoder(self) -> PartsDecoder:
        return self.model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def _skeleton(config):
    """The target's causal LM on the meta device: its modules' classes, shapes and names, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _selected(full, last_layer: bool) -> dict[str, nn.Module]:
    """The modules to load, by their names in the checkpoint: embedding, final norm, head (and last layer)."""
    names = {id(module): name for name, module in full.named_modules()}
    decoder = full.get_decoder()
    chosen = [full.get_input_embeddings(), decoder.norm, full.get_output_embeddings()]
    if last_layer:
        chosen.append(decoder.layers[-1])
    return {names[id(module)]: module for module in chosen}


def parts_parameters(config, last_layer: bool = False) -> int:
    """The parameters `load_target_parts` holds for a target of `config` (a tied head counted once)."""
    tensors = {id(p): p.numel() for module in _selected(_skeleton(config), last_layer).values()
               for p in module.parameters()}
    return sum(tensors.values())


# ---- reading the tensors -----------------------------------------------------------------------------------
def _fetcher(name: str) -> Callable[[str], Path]:
    """File name -> its local path: in the folder `name`, or downloaded alone from the Hub repo `name` (so that a
    70B target's parts fetch the config, the index and the two or three shards that hold them, not all 30)."""
    folder = Path(name)
    if folder.is_dir():
        return folder.joinpath

    def fetch(filename: str) -> Path:
        from huggingface_hub import errors, hf_hub_download

        # the repo has no such file (older clients name it EntryNotFoundError; newer ones also raise that for a
        # file missing from the cache when offline, which must not read as absent)
        missing = getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError)
        try:
            return Path(hf_hub_download(name, filename))
        except missing:
            return folder / filename  # absent: the caller sees no such file
        except Exception as err:  # noqa: BLE001 - offline, gated, no such repo: one line with the fix
            raise ValueError(f"could not fetch {filename} of target {name!r} ({' '.join(str(err).split())}); pass "
                             "a local checkpoint folder or a Hub id reachable from this machine") from None
    return fetch


def read_tensors(name: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of checkpoint `name` (a local folder or a Hub id), reading only the files that hold them;
    a key absent from the checkpoint is left out."""
    fetch = _fetcher(name)
    index = fetch(INDEX)
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    by_file: dict[str, list[str]] = {}
    for key in keys:
        file = weight_map.get(key) if weight_map is not None else WEIGHTS
        if file:
            by_file.setdefault(file, []).append(key)
    out = {}
    for file, wanted in by_file.items():
        path = fetch(file)
        if not Path(path).is_file():
            raise ValueError(f"{name}: no {file} (the target's weights in safetensors); load the whole target with "
                             "states=online, or pass a checkpoint saved with safetensors")
        with safe_open(str(path), "pt") as weights:
            present = set(weights.keys())
            out.update({key: weights.get_tensor(key) for key in wanted if key in present})
    return out


def load_target_parts(name: str, dtype: str = "auto", device: str | torch.device = "auto",
                      last_layer: bool = False) -> TargetParts:
    """The target `name` (a local checkpoint folder or a Hub id) as `TargetParts`: its embedding, final norm and
    head (and its last decoder layer with `last_layer`), in `dtype` on `device`, frozen."""
    from transformers import AutoConfig

    device = device if isinstance(device, torch.device) else resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    check_checkpoint(name)
    config = AutoConfig.from_pretrained(name)
    full = _skeleton(config)
    embed, head = full.get_input_embeddings(), full.get_output_embeddings()
    tied = head.weight is embed.weight  # a tied head is stored once, as the embedding
    modules = {prefix: m for prefix, m in _selected(full, last_layer).items() if not (tied and m is head)}
    tensors = read_tensors(name, [f"{prefix}.{key}" for prefix, m in modules.items() for key in m.state_dict()])
    for prefix, module in modules.items():
        state = {}
        for key in module.state_dict():
            if f"{prefix}.{key}" not in tensors:
                raise ValueError(f"{name}: its weights hold no {prefix}.{key}, which the parts load reads (another "
                                 "layout of names?); load the whole target with states=online")
            state[key] = tensors[f"{prefix}.{key}"].to(device=device, dtype=torch_dtype)
        module.load_state_dict(state, assign=True)
    if tied:
        head.weight = embed.weight
    layers = [NotLoaded(i) for i in range(len(full.get_decoder().layers))]
    if last_layer:
        layers[-1] = full.get_decoder().layers[-1]
    decoder = PartsDecoder(embed, full.get_decoder().norm, nn.ModuleList(layers))
    return TargetParts(config, decoder, head).requires_grad_(False).eval()


def parameter_count(module: nn.Module) -> int:
    """Parameters held, each storage once (a tied head counts once)."""
    return sum({id(p): p.numel() for p in module.parameters()}.values())
