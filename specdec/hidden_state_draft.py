"""What the drafts that read the target's hidden states with a reduced vocabulary share (EAGLE-3, P-EAGLE and
DFlash: specdec/eagle3/model.py, specdec/dflash/model.py).

Such a draft embeds tokens with the target's own table (`embed_tokens`, frozen), projects the target's residual
streams after `layer_ids` with `fc`, and scores `draft_vocab_size` kept target ids with `lm_head` after `norm`.
Draft id i is target id i + d2t[i] (the offsets the engines add); `t2d` marks the kept target ids. Everything
here keeps the engines' weight names, so the checkpoints are those each kind wrote before.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

# The weights a checkpoint may leave out because the engines take the target's: the embedding table
EMBEDDINGS = "embed_tokens.weight"
HEAD = "lm_head.weight"


def target_text(target_config):
    """The target's text config (a multimodal target's language model's)."""
    return target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config


def text_config_kwargs(target_config) -> dict:
    """The decoder widths a draft takes from its target's (text) config, as config keyword arguments."""
    text = target_text(target_config)
    hidden, heads = text.hidden_size, text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or {"rope_type": "default",
                                                       "rope_theta": getattr(text, "rope_theta", 10000.0)}
    return dict(
        vocab_size=text.vocab_size, hidden_size=hidden, intermediate_size=text.intermediate_size,
        num_attention_heads=heads, num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or hidden // heads, hidden_act=text.hidden_act,
        max_position_embeddings=text.max_position_embeddings, rms_norm_eps=text.rms_norm_eps,
        rope_parameters=dict(rope), attention_bias=False, tie_word_embeddings=False,
        bos_token_id=getattr(text, "bos_token_id", None), eos_token_id=getattr(text, "eos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None),
    )


def mark_target(config, target_config, architecture: str, draft_vocab_size: int) -> None:
    """The draft config's keys that name its architecture, its head's rows and the target it reads."""
    config.architectures = [architecture]
    config.draft_vocab_size = int(draft_vocab_size)
    config.target_hidden_size = target_text(target_config).hidden_size
    config.target_architectures = list(getattr(target_config, "architectures", None) or ["LlamaForCausalLM"])


FORMATS = ("engines", "speculators")  # the published layouts of a hidden-state draft, the default first
WEIGHTS_FILE = "model.safetensors"


def write_layout(out_dir: str | Path, format: str, speculators: dict | None, state: dict[str, torch.Tensor],
                 full_vocab: bool, engines_config, speculators_layout) -> None:
    """config.json + model.safetensors of a hidden-state draft in `format` (one of FORMATS): `engines_config()`
    gives the engines' config; `speculators_layout(state, **speculators)` gives speculators' config and its state
    (its weight names), whose vocabulary maps are dropped for a full vocabulary (speculators has none then)."""
    from safetensors.torch import save_file

    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if format == "speculators":
        if speculators is None:
            raise ValueError("format=speculators needs the verifier: speculators={verifier, "
                             "verifier_architectures, num_draft_tokens}")
        written, state = speculators_layout(state, **speculators)
        if full_vocab:
            state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    else:
        written = engines_config()
    (out / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})


def init_weights(module: nn.Module) -> None:
    # Llama's and Qwen3's initialisation (normal, std 0.02); norms start at one.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)


class HiddenStateDraft(nn.Module):
    """The base of such drafts: the parts of the causal-LM interface that the decoder, trainer and loaders use,
    the reduced vocabulary, taking the target's frozen parts, saving, loading and the target check.

    A subclass sets `label` (its name in messages), `retrain` (the fix when a target does not match),
    `target_parts` (the weights a checkpoint may leave to the target) and `formats` (its formats module), and
    calls `register_vocabulary` in its __init__ after its embeddings, fc, norm and head."""

    label: str
    retrain: str
    target_parts: tuple[str, ...] = (EMBEDDINGS,)
    formats = None  # the kind's formats module: read_config, read_state, write, WEIGHTS_FILE

    def register_vocabulary(self, config) -> None:
        """d2t and t2d (saved, read by the engines) and the non-persistent draft_to_target (all ids kept)."""
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=False)

    # ---- the parts of the causal-LM interface that the decoder, trainer and loaders use
    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def set_vocabulary(self, keep_ids: torch.Tensor | None) -> None:
        """Draft ids = the kept target ids in ascending order (None: all); d2t holds the offsets the engines add."""
        vocab, rows = self.config.vocab_size, self.config.draft_vocab_size
        keep = torch.arange(vocab) if keep_ids is None else torch.as_tensor(keep_ids).long().sort().values.cpu()
        if keep.numel() != rows or (keep.numel() and (int(keep[0]) < 0 or int(keep[-1]) >= vocab)) \
                or torch.unique(keep).numel() != keep.numel():
            raise ValueError(f"the draft vocabulary must be {rows} distinct ids in [0, {vocab}), got {keep.numel()}")
        device = self.d2t.device
        self.d2t.copy_((keep - torch.arange(rows)).to(device))
        self.t2d.zero_()
        self.t2d[keep.to(device)] = True
        self.draft_to_target = keep.to(device)

    def kept_ids(self) -> torch.Tensor:
        """The target ids of the draft's logits (ascending), from d2t.  [draft_vocab]"""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    # ---- construction
    @classmethod
    def seeded(cls, config, seed: int):
        """A new draft of `config` whose weights start from `seed` (the global generator left as it was)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            draft = cls(config)
            draft.init_new_weights()
        return draft

    def init_new_weights(self) -> None:
        self.apply(init_weights)

    def take_target_parts(self, target: nn.Module, keep_ids: torch.Tensor | None):
        """This draft on the target's device and dtype with the kept ids, the target's embeddings (frozen), final
        norm and head rows of the kept ids.  Returns the moved draft."""
        self.set_vocabulary(keep_ids)
        param = next(target.parameters())
        draft = self.to(device=param.device, dtype=param.dtype)
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
            draft.norm.weight.copy_(target.get_decoder().norm.weight)
            head = target.get_output_embeddings().weight
            draft.lm_head.weight.copy_(head[draft.kept_ids().to(head.device)])
        draft.embed_tokens.weight.requires_grad_(False)
        return draft

    # ---- saving and loading
    def weights(self, state_dict: dict | None = None) -> dict[str, torch.Tensor]:
        """The weights under the engines' names, on the CPU (no rotary buffers); `state_dict` = a gathered one."""
        state = self.state_dict() if state_dict is None else state_dict
        return {k: v.detach().cpu().contiguous() for k, v in state.items() if not k.startswith("rotary_emb.")}

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32):
        """Load either of the kind's layouts. A checkpoint without `target_parts` (the engines take the target's)
        takes the target's when it first meets it (`adopt_target`)."""
        draft = cls(cls.formats.read_config(path)).to(dtype)
        state = cls.formats.read_state(path)
        draft.needs_target = [k for k in cls.target_parts if k not in state]
        for key in draft.needs_target:
            state[key] = torch.full_like(draft.state_dict()[key], float("nan"))
        try:
            missing, unexpected = draft.load_state_dict(state, strict=False)
        except RuntimeError as err:  # size mismatch: the config and the weights were written for different targets
            first = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err))
            raise ValueError(f"{path}/{cls.formats.WEIGHTS_FILE} does not match its config.json ({first}); "
                             f"re-export the draft (specdec publish) or download it again") from None
        missing = [m for m in missing if not m.startswith("rotary_emb.") and m not in ("d2t", "t2d")]
        if missing or unexpected:
            raise ValueError(f"{path}: {cls.label} weights do not match its config (missing {missing}, "
                             f"unexpected {unexpected})")
        draft.draft_to_target = draft.kept_ids()
        draft.embed_tokens.weight.requires_grad_(False)
        return draft.eval()

    def check_target(self, target: nn.Module, name: str | None = None, target_name: str = "the target") -> None:
        """ValueError (both sizes and the fix) when `target` is not one this draft can read: it embeds tokens with
        the target's own table and reads the target's hidden states, so vocabulary, width and layers must match."""
        name, label, fix = name or f"this {self.label} draft", self.label, self.retrain
        kind = (getattr(target.config, "architectures", None) or [type(target).__name__])[0]
        rows = target.get_input_embeddings().num_embeddings
        if rows != self.config.vocab_size:
            raise ValueError(f"vocabulary mismatch: {name} ({label}) embeds {self.config.vocab_size:,} token ids "
                             f"(config.json vocab_size) but {target_name} ({kind}) has {rows:,}; {fix}")
        width = target.config.get_text_config().hidden_size
        if width != self.config.target_hidden_size:
            raise ValueError(f"{name} ({label}) reads hidden states {self.config.target_hidden_size:,} wide "
                             f"(config.json target_hidden_size) but {target_name} ({kind}) has {width:,}; {fix}")
        layers = len(target.get_decoder().layers)
        if max(self.layer_ids) >= layers:
            raise ValueError(f"{name} ({label}) reads the states after layers {self.layer_ids} but {target_name} "
                             f"({kind}) has {layers} layers; {fix}")

    def adopt_target(self, target: nn.Module) -> None:
        """Share the target's embeddings (and take its head rows) where this draft's checkpoint stored none, as the
        engines do."""
        if getattr(self, "needs_target", None):
            self.check_target(target)
            with torch.no_grad():
                if EMBEDDINGS in self.needs_target:
                    self.embed_tokens.weight = target.get_input_embeddings().weight
                if HEAD in self.needs_target:
                    head = target.get_output_embeddings().weight
                    self.lm_head.weight.copy_(head[self.kept_ids().to(head.device)])
            self.needs_target = []
