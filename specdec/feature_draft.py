"""A feature-conditioned draft: it reads the target's last hidden state as well as the tokens.

A plain draft must rebuild the context from tokens alone with a few layers. This one is given, at each
position t, the target's own final hidden state f_t (post-norm, the vector its LM head reads) together with
the next token x_{t+1}, and predicts f_{t+1}, from which its head proposes x_{t+2}. This is the design of
EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty",
arXiv:2401.15077): one decoder layer over fc([embed(x_{t+1}); f_t]).

Optionally f_t also carries the outputs of a few earlier target layers (`aux_layers`, e.g. a low, a middle and
a late one), as EAGLE-3 fuses low, middle and high features (Li et al. 2025, arXiv:2503.01840): the final
feature is tuned to predict x_{t+1} alone, while earlier layers still hold more of the context that x_{t+2}
needs. Measured on SmolLM2-135M (3 extra layers, same data and steps): held-out first-proposal agreement
0.448 -> 0.474 on the embedded prompts, 0.293 -> 0.327 on Spec-Bench. Later proposals of a round, which read
the draft's own predicted final feature, get zeros in place of the auxiliary parts (and are trained so).

While drafting beyond the first token the true f is not known yet, so the draft feeds back its own
prediction; after each verification the target's true features replace them (`_FeatureDraft` in
specdec/decode.py). Verification is unchanged, so decoding stays exact whatever the draft proposes.

The module is built from the target's config with `num_hidden_layers` = the draft's depth and is saved as
`config.json` (that config plus `specdec_feature_draft: true`) + `model.safetensors` (+ the reduced
vocabulary's id map, specdec/vocab.py). It is specdec's own format: transformers' `assistant_model`, vLLM
and SGLang do not read it (their EAGLE loaders expect their own weight names).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import torch
from torch import nn

from specdec import vocab

CONFIG_FLAG = "specdec_feature_draft"
AUX_KEY = "specdec_feature_aux_layers"  # target layers whose outputs f carries besides the final feature
WEIGHTS_FILE = "model.safetensors"


def is_feature_draft_dir(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get(CONFIG_FLAG))


def feature_layers(target: nn.Module, aux_layers: list[int] | tuple[int, ...] = ()) -> list[nn.Module]:
    """The modules whose outputs make up f, in order: the final norm, then each auxiliary decoder layer."""
    layers = target.get_decoder().layers
    n = len(layers)
    if any(not -n <= i < n for i in aux_layers):
        raise ValueError(f"feature_aux_layers must name layers of the target's {n} (0..{n - 1} or negative), "
                         f"got {list(aux_layers)}")
    return [final_norm(target)] + [layers[i] for i in aux_layers]


def final_norm(target: nn.Module) -> nn.Module:
    """The target's last norm before its head (the module whose output is the feature f)."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", None)
    norm = getattr(decoder, "norm", None)
    if norm is None:
        raise ValueError(f"{type(target).__name__} has no `model.norm`; feature drafts support Llama-style decoders")
    return norm


class FeatureDraft(nn.Module):
    """fc([embed(x_{t+1}); f_t (; aux_t)]) -> n decoder layers of the target's architecture -> norm -> f^_{t+1}
    -> head."""

    is_feature_draft = True

    def __init__(self, config):
        super().__init__()
        from transformers import AutoModel

        self.config = config
        hidden = config.hidden_size
        self.model = AutoModel.from_config(config)  # embeddings, decoder layers, final norm, rotary
        # The target's features are post-norm vectors far larger than token embeddings (SmolLM2: norm ~45 vs
        # ~3); normalised to the embeddings' scale first, as EAGLE-3 normalises both inputs, so that the fc
        # weights of the two halves learn at comparable rates.
        self.feature_norm = copy.deepcopy(self.model.norm)
        # Auxiliary target layers' outputs (pre-norm residual streams, of widely different scales) get a norm each.
        self.aux_layers = list(getattr(config, AUX_KEY, None) or [])
        self.aux_norms = nn.ModuleList(copy.deepcopy(self.model.norm) for _ in self.aux_layers)
        self.fc = nn.Linear((2 + len(self.aux_layers)) * hidden, hidden, bias=True)
        rows = getattr(config, vocab.CONFIG_KEY, None) or config.vocab_size
        self.lm_head = nn.Linear(hidden, rows, bias=False)
        # Keyword of the cache in the body's forward: `cache` in transformers >= 5.2x, `past_key_values` before.
        from specdec.decode import cache_kwarg

        self.cache_kwarg = cache_kwarg(self.model)

    # The parts of the causal-LM interface the decoder, trainer and loaders use.
    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def feature_width(self) -> int:
        """Width of the f it reads where the target's are known: the final feature and each auxiliary layer's."""
        return (1 + len(self.aux_layers)) * self.config.hidden_size

    def predict_features(self, input_ids, features, position_ids=None, attention_mask=None, cache=None):
        """The predicted features f^_{t+1} [B, n, H] for tokens x_{t+1} [B, n] and features f_t [B, n, W]: the
        target's (W = feature_width) or the draft's own prediction (W = H, auxiliary parts then read as zeros)."""
        embeds = self.get_input_embeddings()(input_ids)
        hidden = self.config.hidden_size
        features = features.to(embeds.dtype)
        parts = [embeds, self.feature_norm(features[..., :hidden])]
        for i, norm in enumerate(self.aux_norms, start=1):
            aux = features[..., i * hidden : (i + 1) * hidden]
            parts.append(norm(aux) if aux.shape[-1] else embeds.new_zeros(embeds.shape))
        inputs = self.fc(torch.cat(parts, dim=-1))
        out = self.model(inputs_embeds=inputs, position_ids=position_ids, attention_mask=attention_mask,
                         use_cache=cache is not None, **{self.cache_kwarg: cache})
        return out.last_hidden_state

    def forward(self, input_ids, features, position_ids=None, attention_mask=None, cache=None, logits_to_keep=0,
                head=True):
        """(predicted features [B, n, H], logits [B, n or logits_to_keep, rows] or None when head=False) for
        tokens x_{t+1} and features f_t."""
        hidden = self.predict_features(input_ids, features, position_ids, attention_mask, cache)
        if not head:
            return hidden, None
        return hidden, self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)

    @classmethod
    def from_target(cls, target: nn.Module, init_layers: list[int], keep_ids: torch.Tensor | None = None,
                    aux_layers: list[int] | tuple[int, ...] = ()) -> FeatureDraft:
        """A draft of len(init_layers) layers copied from the target's, with its embeddings, final norm and head
        rows, reading the outputs of target layers `aux_layers` as well as the final feature."""
        config = copy.deepcopy(target.config.get_text_config() if hasattr(target.config, "get_text_config")
                               else target.config)
        layers = target.get_decoder().layers
        n = len(layers)
        picked = [i % n for i in init_layers]
        if not picked or any(not -n <= i < n for i in init_layers):
            raise ValueError(f"draft_layers must name 1+ of the target's {n} layers (0..{n - 1} or negative), "
                             f"got {init_layers}")
        config.num_hidden_layers = len(picked)
        if getattr(config, "layer_types", None):  # per-layer attention kinds (Qwen2, Gemma): keep the picked ones
            config.layer_types = [config.layer_types[i] for i in picked]
        config.tie_word_embeddings = False
        config.architectures = ["SpecdecFeatureDraft"]
        setattr(config, CONFIG_FLAG, True)
        config.specdec_feature_layers = picked
        feature_layers(target, aux_layers)  # checks the indices
        setattr(config, AUX_KEY, [i % n for i in aux_layers])
        if keep_ids is not None:
            setattr(config, vocab.CONFIG_KEY, int(keep_ids.numel()))
        draft = cls(config).to(device=next(target.parameters()).device, dtype=next(target.parameters()).dtype)
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
            for mine, i in zip(draft.model.layers, picked):
                mine.load_state_dict(layers[i].state_dict())
            draft.model.norm.load_state_dict(final_norm(target).state_dict())
            embed_rms = target.get_input_embeddings().weight.float().pow(2).mean().sqrt()
            for norm in (draft.feature_norm, *draft.aux_norms):
                norm.weight.fill_(float(embed_rms))
            head = target.get_output_embeddings().weight
            draft.lm_head.weight.copy_(head if keep_ids is None else head[keep_ids.to(head.device)])
            # The token half starts as a pass-through of the embedding and the feature half at zero, so the
            # untrained draft is the picked layers reading tokens (a derived draft, shifted by one position:
            # the same function under rotary embeddings). Features are ~15x the embeddings' norm on SmolLM2,
            # so even a small random start on their half would drown the tokens; its gradient is not zero.
            hidden = config.hidden_size
            draft.fc.weight.zero_()
            draft.fc.weight[:, :hidden].copy_(torch.eye(hidden))
            draft.fc.bias.zero_()
        if keep_ids is not None:
            draft.register_buffer("draft_to_target", keep_ids.to(draft.device), persistent=False)
        return draft

    def save_pretrained(self, out_dir: str | Path, state_dict: dict | None = None, **_ignored) -> None:
        """config.json + model.safetensors (+ the id map); `state_dict` = a gathered one (FSDP, DeepSpeed)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(out)
        state = {k: v.detach().cpu().contiguous() for k, v in (state_dict or self.state_dict()).items()}
        save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        vocab.save_vocab_map(self, out)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> FeatureDraft:
        from safetensors.torch import load_file
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path))
        draft = cls(config).to(dtype)  # before loading, so that float64 weights keep their precision
        state = load_file(str(Path(path) / WEIGHTS_FILE))
        missing, unexpected = draft.load_state_dict(state, strict=False)
        if unexpected or [m for m in missing if not m.endswith("inv_freq")]:
            raise ValueError(f"{path}: feature-draft weights do not match its config "
                             f"(missing {missing}, unexpected {unexpected})")
        if getattr(config, vocab.CONFIG_KEY, None):
            draft.register_buffer("draft_to_target", vocab.load_vocab_map(path), persistent=False)
        return draft.eval()


class FeatureRecorder:
    """Keeps the features f of the target's latest forward, [B, n, W]: its final norm's output, followed by the
    outputs of decoder layers `aux_layers` (W = (1 + len(aux_layers)) x H).

    With `history=True` it also keeps every forward's features (float16, on the CPU) in `history`, in order: a
    decode loop's prefill, then one entry per step (what `specdec data record_features=true` stores)."""

    def __init__(self, target: nn.Module, aux_layers: list[int] | tuple[int, ...] = (), history: bool = False):
        self._parts: list[torch.Tensor | None] = [None] * (1 + len(aux_layers))
        self.history: list[torch.Tensor] | None = [] if history else None
        self._handles = [module.register_forward_hook(functools.partial(self._keep, i))
                         for i, module in enumerate(feature_layers(target, aux_layers))]

    def _keep(self, index: int, _module, _inputs, output) -> None:
        self._parts[index] = output[0] if isinstance(output, tuple) else output  # some decoder layers return tuples
        if index == 0 and self.history is not None:  # the final norm runs after every decoder layer of a forward
            self.history.append(self.latest.detach().to("cpu", torch.float16))

    @property
    def latest(self) -> torch.Tensor | None:
        if self._parts[0] is None:
            return None
        return self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts, dim=-1)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def __enter__(self) -> FeatureRecorder:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
