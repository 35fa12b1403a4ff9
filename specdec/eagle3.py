"""EAGLE-3 drafts (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv:2503.01840), computed as the serving engines compute them.

The draft reads, at draft position t, the token x_{t+1} and three of the target's hidden states at t, and
proposes x_{t+2}. Its one decoder layer is a Llama layer whose attention reads twice the hidden width:

    h       = fc(cat(a_1, a_2, a_3))                 a_i: the target's residual stream after layer id i
    x       = cat(input_layernorm(embed(x_{t+1})), hidden_norm(h))          [.., 2H]
    r       = attn(x) + h                             (hidden_norm(h) instead of h with norm_before_residual)
    out     = mlp(post_attention_layernorm(r)) + r    the pre-norm output, fed back as h on the next step
    logits  = lm_head(norm(out))                      over `draft_vocab_size` ids; target id = id + d2t[id]

This is what vLLM 0.32's `Eagle3LlamaForCausalLM` computes (vllm/model_executor/models/llama_eagle3.py) and
what SGLang's `LlamaForCausalLMEagle3` loads; the layer ids count "after i decoder layers", as vLLM's
`eagle_aux_hidden_state_layer_ids` does (default (2, N // 2, N - 3)). The weights keep the engines' names
(`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, `embed_tokens`), so a checkpoint saved here is served
unchanged (train/publish.py writes the engines' config keys).

Later proposals of a round read the draft's own pre-norm output instead of fc's (`from_target=False`). Training
unrolls those steps ("training-time test") with an attention that costs each step the same (`unrolled`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from specdec.drafter import Drafter
from specdec.eagle3_attention import unrolled_attention
from specdec.kv import Batch, rollback
from specdec.replay import RANK_CAP, true_token_ranks

ARCHITECTURE = "LlamaForCausalLMEagle3"  # the name vLLM and SGLang both resolve to their EAGLE-3 Llama draft
WEIGHTS_FILE = "model.safetensors"
FORMATS = ("engines", "speculators")  # the published layouts (save_pretrained)
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format `format="speculators"` writes
OLD_FEATURE_FLAG = "specdec_feature_draft"  # specdec's earlier feature-draft layout (replaced by this one)
# How recorded target states are stored: bf16 keeps float32's range, which the residual streams of large targets
# need (their outlier dimensions reach magnitudes where float16 loses precision or overflows); the peers store
# bf16 too. Folders written in float16 by earlier versions still read (every reader casts to float32).
RECORDED_STATES_DTYPE = torch.bfloat16


def default_layer_ids(num_layers: int) -> list[int]:
    """vLLM's and SGLang's default auxiliary layers: after 2, N // 2 and N - 3 decoder layers."""
    if num_layers < 7:
        raise ValueError(f"the engines' default EAGLE-3 layers (2, N // 2, N - 3) repeat for a {num_layers}-layer "
                         f"target: name them with eagle_aux_layer_ids (distinct ids in 1..{num_layers - 1})")
    return [2, num_layers // 2, num_layers - 3]


def check_layer_ids(layer_ids, num_layers: int) -> list[int]:
    """Sorted, distinct ids in 1..N-1 (id i = the residual stream after i of the target's N layers)."""
    ids = sorted(int(i) for i in layer_ids)
    if not ids or len(set(ids)) != len(ids) or ids[0] < 1 or ids[-1] > num_layers - 1:
        raise ValueError(f"eagle_aux_layer_ids must be distinct ids in 1..{num_layers - 1} (the residual stream "
                         f"after that many of the target's {num_layers} layers), got {list(layer_ids)}")
    return ids


def is_eagle3_config(config: dict) -> bool:
    """The engines' layout (architecture LlamaForCausalLMEagle3) or speculators' (speculators_model_type eagle3)."""
    return ARCHITECTURE in (config.get("architectures") or []) or config.get("speculators_model_type") == "eagle3"


def is_eagle3_dir(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and is_eagle3_config(json.loads(config.read_text()))


def check_not_old_feature_draft(path: str | Path) -> None:
    """The earlier feature-draft layout computes something else: no exact conversion exists, so say how to retrain."""
    config = Path(path) / "config.json"
    if config.is_file() and json.loads(config.read_text()).get(OLD_FEATURE_FLAG):
        raise ValueError(
            f"{path} is a feature draft in specdec's earlier layout (draft: feature), which no engine serves and "
            "this version no longer decodes. Its one layer read other inputs, so it cannot be converted exactly: "
            "retrain it as an EAGLE-3 draft, e.g. `specdec train --config recipes/smollm2-135m-eagle3.yaml` "
            "(draft: eagle3; the data stage's recorded features are reused)")


def draft_config(target_config, layer_ids: list[int], draft_vocab_size: int) -> LlamaConfig:
    """The draft layer's Llama config from the target's (same widths), with the engines' EAGLE-3 keys."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    hidden, heads = text.hidden_size, text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or {"rope_type": "default",
                                                       "rope_theta": getattr(text, "rope_theta", 10000.0)}
    config = LlamaConfig(
        vocab_size=text.vocab_size, hidden_size=hidden, intermediate_size=text.intermediate_size,
        num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or hidden // heads, hidden_act=text.hidden_act,
        max_position_embeddings=text.max_position_embeddings, rms_norm_eps=text.rms_norm_eps,
        rope_parameters=dict(rope), attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        bos_token_id=getattr(text, "bos_token_id", None), eos_token_id=getattr(text, "eos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None),
    )
    config.architectures = [ARCHITECTURE]
    config.draft_vocab_size = int(draft_vocab_size)
    config.target_hidden_size = hidden
    config.target_num_hidden_layers = text.num_hidden_layers
    config.target_architectures = list(getattr(target_config, "architectures", None) or ["LlamaForCausalLM"])
    config.eagle_aux_hidden_state_layer_ids = list(layer_ids)
    # Written out, not left to defaults: vLLM's plain path defaults it to false, speculators' format to true.
    config.norm_before_residual = False
    return config


class Eagle3Layer(nn.Module):
    """The draft's decoder layer: q/k/v read cat(input_layernorm(embeds), hidden_norm(h)), the residual is h."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.input_layernorm = LlamaRMSNorm(hidden, eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * hidden, self.heads * self.head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.mlp = LlamaMLP(config)

    def qkv(self, embeds, hidden, cos, sin):
        """Queries [B, heads, n, d], keys and values [B, kv_heads, n, d] (rotary applied), and the residual."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, n, 2H]
        b, n, _ = x.shape
        attn = self.self_attn
        q = attn.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v, residual

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o_proj, residual, MLP: the layer's pre-norm output from attention's output [B, heads, n, d].  [B, n, H]"""
        b, _, n, _ = attended.shape
        r = self.self_attn.o_proj(attended.transpose(1, 2).reshape(b, n, -1)) + residual
        return self.mlp(self.post_attention_layernorm(r)) + r


class Eagle3Draft(nn.Module):
    """An EAGLE-3 draft over a target (see the module docstring); `draft_to_target` maps its logits to target ids."""

    # How the serving engines run it (train/publish.py and the card read these; a plain causal LM has neither):
    # vLLM's speculative method, SGLang's algorithm. Both read the reduced vocabulary's d2t themselves.
    vllm_method = "eagle3"
    sglang_algorithm = "EAGLE3"

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.layer_ids = list(config.eagle_aux_hidden_state_layer_ids)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)  # the target's, frozen
        self.fc = nn.Linear(len(self.layer_ids) * config.target_hidden_size, hidden, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
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

    def _rotary(self, x: torch.Tensor, position_ids: torch.Tensor):
        return self.rotary_emb(x, position_ids)

    def hidden_in(self, hidden: torch.Tensor, from_target: bool) -> torch.Tensor:
        """h of the layer: fc of the target's concatenated hidden states, or the draft's own previous output."""
        return self.fc(hidden.to(self.fc.weight.dtype)) if from_target else hidden

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                from_target: bool = True, cache: DynamicCache | None = None,
                attention_mask: torch.Tensor | None = None, logits_to_keep: int = 0, ttt_steps: int = 0,
                tree_mask: torch.Tensor | None = None, document_ids: torch.Tensor | None = None):
        """One cached step: (pre-norm outputs [B, n, H], logits [B, n or logits_to_keep, draft_vocab]).

        `attention_mask` [B, past + n] marks real (1) and padding (0) positions of the cache and the new ones;
        `tree_mask` [n, past + n] (True = may attend) replaces causal attention for a draft tree's nodes.
        With `ttt_steps` > 0 it returns `unrolled(input_ids, hidden, attention_mask, ttt_steps, document_ids)`
        instead: training calls it through forward so that a DDP wrapper synchronises the gradients."""
        if ttt_steps:
            return self.unrolled(input_ids, hidden, attention_mask, ttt_steps, document_ids)
        h = self.hidden_in(hidden, from_target)
        embeds = self.embed_tokens(input_ids)
        cos, sin = self._rotary(h, position_ids)
        q, k, v, residual = self.midlayer.qkv(embeds, h, cos, sin)
        past = cache.get_seq_length() if cache is not None else 0
        if cache is not None:
            k, v = cache.update(k, v, 0)
        n, total = q.shape[2], k.shape[2]
        allowed = torch.arange(total, device=q.device)[None, :] <= past + torch.arange(n, device=q.device)[:, None]
        allowed = allowed[None, None]  # [1, 1, n, total]
        if tree_mask is not None:
            allowed = tree_mask.to(q.device)[None, None]
        elif attention_mask is not None:
            # A padding query may have no real key before it: letting it see itself keeps its row finite.
            itself = torch.arange(total, device=q.device)[None, :] == past + torch.arange(n, device=q.device)[:, None]
            allowed = (allowed & attention_mask[:, None, None, :total].bool()) | itself[None, None]
        rep = self.midlayer.heads // self.midlayer.kv_heads
        attended = F.scaled_dot_product_attention(q, repeat_kv(k, rep), repeat_kv(v, rep), attn_mask=allowed)
        out = self.midlayer.finish(attended, residual)
        kept = out[:, -logits_to_keep:] if logits_to_keep else out
        return out, self.lm_head(self.norm(kept))

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Draft logits of pre-norm outputs.  [..., H] -> [..., draft_vocab]"""
        return self.lm_head(self.norm(prenorm))

    def unrolled(self, input_ids: torch.Tensor, target_hidden: torch.Tensor, attention_mask: torch.Tensor,
                 steps: int, document_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training-time test: the pre-norm outputs [B, n, H] of each of `steps` unrolled proposals, n = S - 1.

        Step 1 at draft position t reads (x_{t+1}, the target's hidden states at t) with causal attention: the
        first proposal of a round whose last true position is t. Step j at t reads (x_{t+1}, step j-1's output at
        t - 1): the j-th proposal of the round whose last true position is s = t - (j - 1). At decode time that
        proposal attends to the cache: true positions <= s (step 1's keys there) and the round's own proposals
        at s + 1 .. t (step i's key at t - (j - i), i = 2..j). Those are exactly the keys used here, so the
        unrolled outputs equal the decoder's proposals. Each step costs one causal attention over step 1's keys
        plus j - 1 single diagonal keys, so the cost grows linearly in `steps` (a dense mask over all steps' keys
        would grow quadratically); that attention runs in chunks of queries, recomputed in backward, so memory
        grows linearly in n (specdec/eagle3_attention.py).  input_ids, attention_mask: [B, S] (rows right-padded);
        target_hidden: [B, S, 3 H_target].

        `document_ids` [B, S] (packed rows: each row several documents, each a contiguous run of positions) makes
        each document's outputs those of the document alone: draft position t belongs to position t's document,
        attends only within it, takes rotary positions counted from the document's start, and a document's first
        position reads no earlier step output. The position reading the next document's first token (the last of
        each document but the row's last) has no counterpart alone: its loss must be masked."""
        ids, valid = input_ids[:, 1:], attention_mask[:, 1:].bool()
        b, n = ids.shape
        docs = None if document_ids is None else document_ids[:, :-1]  # draft position t: its hidden state's document
        positions = torch.arange(n, device=ids.device)[None].expand(b, n) if docs is None else positions_in_documents(docs)
        embeds = self.embed_tokens(ids)
        h = self.hidden_in(target_hidden[:, :-1], from_target=True)
        cos, sin = self._rotary(h, positions)
        layer = self.midlayer
        first_keys = first_values = None
        diag_keys, diag_values, outputs = [], [], []
        for step in range(1, steps + 1):
            q, k, v, residual = layer.qkv(embeds, h, cos, sin)
            if step == 1:
                first_keys, first_values = k, v
            else:  # step i's key at t - (step - i) for i = 2..step: the round's own earlier proposals (and this one)
                diag_keys.append(k)
                diag_values.append(v)
            attended = unrolled_attention(q, first_keys, first_values, diag_keys, diag_values, valid, docs)
            out = layer.finish(attended, residual)
            outputs.append(out)
            # the next step at t reads this step's output at t - 1 (no fc: the draft's own hidden width)
            h = F.pad(out[:, :-1], (0, 0, 1, 0))
            if docs is not None:  # a document's first position reads nothing before it, as alone
                h = h.masked_fill((positions == 0)[..., None], 0.0)
        return outputs

    # ---- teacher-forced replay (specdec/replay.py)
    @torch.no_grad()
    def read_target(self, target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The target's residual stream after each of `layer_ids`, concatenated; no head computed.  [B, S, 3 H]"""
        self.adopt_target(target)
        with HiddenStateRecorder(target, self.layer_ids) as recorder:
            target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask)
            return recorder.latest

    @torch.no_grad()
    def replay_ranks(self, input_ids, attention_mask, loss_mask, steps: int, states) -> list[list[list[int]]]:
        """For each scored position p (p predicts completion token p + 1) of each row: the ranks of tokens
        p + 1 .. p + steps among this draft's proposals 1..steps of the round whose first proposal is token p + 1,
        unrolled exactly as the decoder proposes (specdec/replay.py: replay_ranks)."""
        outs = self.unrolled(input_ids, states, attention_mask, steps)
        # step j's output at draft position t proposes token t + 2 (t + 2 - j is the round's last true position)
        ranks = torch.stack([true_token_ranks(self.logits(o)[:, :-1], input_ids[:, 2:], self.draft_to_target)
                             for o in outs]).tolist()  # [j][B][n - 1]
        out = []
        for b, scored in enumerate(loss_mask.tolist()):
            row = []
            for p in (p for p, s in enumerate(scored) if s):
                position = []
                for j in range(1, steps + 1):  # the round's j-th proposal is token p + j, at draft position p + j - 2
                    t, token = p + j - 2, p + j
                    inside = t >= 0 and token < len(scored) and scored[token - 1]
                    position.append(ranks[j - 1][b][t] if inside else RANK_CAP)
                row.append(position)
            out.append(row)
        return out

    # ---- construction, saving and loading
    @classmethod
    def from_target(cls, target: nn.Module, layer_ids: list[int] | None = None,
                    keep_ids: torch.Tensor | None = None, seed: int = 0) -> Eagle3Draft:
        """A new draft for `target`: its frozen embeddings, its final norm and head rows (the kept ids), and a
        randomly initialised fc and layer (seeded), reading the target's residual stream after `layer_ids`."""
        num_layers = len(target.get_decoder().layers)
        ids = check_layer_ids(layer_ids or default_layer_ids(num_layers), num_layers)
        vocab = target.get_input_embeddings().num_embeddings
        config = draft_config(target.config, ids, vocab if keep_ids is None else int(keep_ids.numel()))
        config.vocab_size = vocab
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            draft = cls(config)
            draft.apply(_init_weights)
        draft.set_vocabulary(keep_ids)
        param = next(target.parameters())
        draft = draft.to(device=param.device, dtype=param.dtype)
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
            draft.norm.weight.copy_(target.get_decoder().norm.weight)
            head = target.get_output_embeddings().weight
            draft.lm_head.weight.copy_(head[draft.kept_ids().to(head.device)])
        draft.embed_tokens.weight.requires_grad_(False)
        return draft

    def state_for_engines(self) -> dict[str, torch.Tensor]:
        """The weights under the engines' names (vLLM maps `midlayer.` to `layers.0.`; SGLang reads it as is)."""
        return {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()
                if not k.startswith("rotary_emb.")}

    def engine_config(self) -> dict:
        """config.json for vLLM (`method: eagle3`) and SGLang (`EAGLE3`): the draft layer's Llama config plus every
        EAGLE-3 key either engine reads, written out rather than left to defaults that differ between them."""
        config = self.config.to_dict()
        ids = list(self.layer_ids)
        rope = dict(config.get("rope_parameters") or {})
        config.update(
            architectures=[ARCHITECTURE], model_type="llama", num_hidden_layers=1, tie_word_embeddings=False,
            draft_vocab_size=self.config.draft_vocab_size, target_hidden_size=self.config.target_hidden_size,
            # vLLM reads the top-level ids ("after i layers") before eagle_config's; SGLang reads eagle_config's
            # and counts "output of layer i" (it adds one): the same layers, in each engine's numbering.
            eagle_aux_hidden_state_layer_ids=ids, num_aux_hidden_states=len(ids),
            eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True},
            norm_before_residual=self.midlayer.norm_before_residual, norm_before_fc=False, fc_norm=False,
            norm_output=False,
            # transformers < 5 (which some engine releases pin) read rope_theta / rope_scaling, not rope_parameters
            rope_theta=rope.get("rope_theta", 10000.0),
            rope_scaling=None if rope.get("rope_type", "default") == "default" else rope,
        )
        return config

    def speculators_config(self, verifier: str, verifier_architectures: list[str], num_draft_tokens: int) -> dict:
        """config.json in vLLM speculators' format (speculators 0.9's `Eagle3DraftModel`; `vllm serve DIR` detects
        it and serves DIR as the draft of `verifier`). No top-level model_type: vLLM reads it as this format."""
        layer = self.engine_config()
        for key in ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                    "num_aux_hidden_states", "eagle_config", "norm_before_residual", "norm_before_fc", "fc_norm",
                    "norm_output", "target_num_hidden_layers", "target_architectures"):
            layer.pop(key, None)
        return {
            "architectures": ["Eagle3DraftModel"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_draft_tokens),
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": self.config.draft_vocab_size,
            "target_hidden_size": self.config.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.layer_ids),
            # vLLM reading this format defaults norm_before_residual to true, speculators to false: written out.
            "norm_before_residual": self.midlayer.norm_before_residual, "norm_before_fc": False, "fc_norm": False,
            "norm_output": False, "embed_requires_grad": False, "tie_word_embeddings": False,
            "torch_dtype": str(self.dtype).removeprefix("torch."),
        }

    def save_pretrained(self, out_dir: str | Path, state_dict: dict | None = None, format: str = "engines",
                        speculators: dict | None = None, **_ignored) -> None:
        """config.json + model.safetensors; `state_dict` = a gathered one (FSDP, DeepSpeed).

        format="engines": the layout vLLM (`method: eagle3`) and SGLang (`EAGLE3`) load, weights under `midlayer.`.
        format="speculators": speculators' own layout (`speculators` = `speculators_config`'s arguments), weights
        under `layers.0.` as its `Eagle3DraftModel` names them. Both store an exact copy of the target's
        embeddings: vLLM then shares the target's, SGLang overwrites them, and speculators 0.9 under
        transformers 5 would otherwise run with uninitialised ones."""
        from safetensors.torch import save_file

        if format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = self.state_for_engines() if state_dict is None else {
            k: v.detach().cpu().contiguous() for k, v in state_dict.items() if not k.startswith("rotary_emb.")}
        if format == "speculators":
            if speculators is None:
                raise ValueError("format=speculators needs the verifier: speculators={verifier, "
                                 "verifier_architectures, num_draft_tokens}")
            config = self.speculators_config(**speculators)
            state = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
            if self.config.draft_vocab_size == self.config.vocab_size:  # speculators has no map then
                state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
        else:
            config = self.engine_config()
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> Eagle3Draft:
        """Load either layout (engines' or speculators'). A checkpoint without embeddings (the engines share the
        target's) takes the target's when it first meets it (`adopt_target`)."""
        from safetensors.torch import load_file

        raw = json.loads((Path(path) / "config.json").read_text())
        if raw.get("speculators_model_type") == "eagle3":
            layer = dict(raw.get("transformer_layer_config") or {})
            raw = {**layer, **{k: v for k, v in raw.items() if k not in ("transformer_layer_config", "architectures")}}
        raw.pop("model_type", None)
        config = LlamaConfig(**raw)
        config.architectures = [ARCHITECTURE]
        for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
            if getattr(config, key, None) is None:
                raise ValueError(f"{path}/config.json lacks {key}: not an EAGLE-3 draft config")
        config.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        for flag in ("norm_before_fc", "fc_norm", "norm_output"):
            if getattr(config, flag, False):
                raise ValueError(f"{path}: {flag}=true EAGLE-3 drafts are not supported by specdec's decoder yet")
        draft = cls(config).to(dtype)
        state = load_file(str(Path(path) / WEIGHTS_FILE))
        state = {k.replace("layers.0.", "midlayer."): v for k, v in state.items()}
        draft.needs_target_embeddings = "embed_tokens.weight" not in state
        if draft.needs_target_embeddings:
            state["embed_tokens.weight"] = torch.full_like(draft.embed_tokens.weight, float("nan"))
        missing, unexpected = draft.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.startswith("rotary_emb.") and m not in ("d2t", "t2d")]
        if missing or unexpected:
            raise ValueError(f"{path}: EAGLE-3 weights do not match its config (missing {missing}, "
                             f"unexpected {unexpected})")
        draft.draft_to_target = draft.kept_ids()
        draft.embed_tokens.weight.requires_grad_(False)
        return draft.eval()

    def adopt_target(self, target: nn.Module) -> None:
        """Share the target's input embeddings when this draft's checkpoint stored none (as the engines do)."""
        if getattr(self, "needs_target_embeddings", False):
            weight = target.get_input_embeddings().weight
            if weight.shape != self.embed_tokens.weight.shape:
                raise ValueError(f"the target embeds {tuple(weight.shape)}, the draft expects "
                                 f"{tuple(self.embed_tokens.weight.shape)}: another target?")
            self.embed_tokens.weight = weight
            self.needs_target_embeddings = False

    def make_drafter(self, target, sampling):
        """The decoder's side of this draft (specdec/drafter.py's interface)."""
        self.adopt_target(target)
        return Eagle3Drafter(self, target, sampling)


def positions_in_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Each position's offset from the start of its document (documents are contiguous runs).  [B, n] -> [B, n]"""
    index = torch.arange(document_ids.shape[1], device=document_ids.device)[None].expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def _init_weights(module: nn.Module) -> None:
    # Llama's initialisation (normal, std 0.02); norms start at one.
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)


class HiddenStateRecorder:
    """The target's residual stream after each of `layer_ids` decoder layers, from its latest forward, [B, n, 3H]
    (forward hooks on the decoder layers; no second forward). With `final=True` the final norm's output (what
    the head reads) comes first: the online teacher's input. `history=True` keeps every forward's states
    (RECORDED_STATES_DTYPE, on the CPU), in order: what `specdec data record_features=true` stores."""

    def __init__(self, target: nn.Module, layer_ids: list[int], final: bool = False, history: bool = False):
        layers = target.get_decoder().layers
        ids = check_layer_ids(layer_ids, len(layers)) if layer_ids or not final else []
        modules = ([target.get_decoder().norm] if final else []) + [layers[i - 1] for i in ids]
        self._parts: list[torch.Tensor | None] = [None] * len(modules)
        self._last = len(modules) - 1 if not final else 0  # the module that runs last in a forward
        self.history: list[torch.Tensor] | None = [] if history else None
        self._handles = [m.register_forward_hook(self._keeper(i)) for i, m in enumerate(modules)]

    def _keeper(self, index: int):
        def keep(_module, _inputs, output) -> None:
            self._parts[index] = output[0] if isinstance(output, tuple) else output
            if index == self._last and self.history is not None:
                self.history.append(self.latest.detach().to("cpu", RECORDED_STATES_DTYPE))
        return keep

    @property
    def latest(self) -> torch.Tensor | None:
        if any(p is None for p in self._parts):
            return None
        return self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts, dim=-1)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def __enter__(self) -> HiddenStateRecorder:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


class _HiddenWindow:
    """The target's hidden states at the positions the draft has yet to read, [B, n, W] from position `start`.

    Written after each target forward (prompt, then each verification), read once per round; what the draft has
    read is then dropped, since its KV cache holds it: the buffer stays a few positions long."""

    def __init__(self, prompt_states: torch.Tensor):
        self.start, self.values = 0, prompt_states

    def write(self, position: int, values: torch.Tensor) -> None:
        """States from `position` on (later positions, read with guessed states, are replaced)."""
        self.values = torch.cat([self.values[:, : position - self.start], values], dim=1)

    def read(self, start: int, stop: int) -> torch.Tensor:
        """States at positions start..stop-1; positions before `stop` are then dropped (the next round starts there)."""
        out = self.values[:, start - self.start : stop - self.start]
        self.values, self.start = self.values[:, stop - self.start :], stop
        return out


class Eagle3Drafter(Drafter):
    """Drafting with an EAGLE-3 draft: draft position t reads x_{t+1} and the target's hidden states at t.

    A round starting at length L first feeds the positions the draft has not read, up to L - 2, with the target's
    states, then feeds back its own output for each further proposal. Those guessed positions (L - 1 on) are
    dropped afterwards (`rollback`): the next round re-reads them with the target's states, which its
    verification forward has computed by then (`observe`)."""

    def __init__(self, draft: Eagle3Draft, target: nn.Module, sampling):
        super().__init__(draft, target, sampling)
        self.recorder = HiddenStateRecorder(target, draft.layer_ids)
        self.cache = DynamicCache(config=draft.config)
        self.window: _HiddenWindow | None = None
        self.round_length = 1

    def start(self, batch: Batch) -> None:
        self.window = _HiddenWindow(self.recorder.latest)

    def observe(self, position: int, keep: list[int] | None = None) -> None:
        states = self.recorder.latest
        self.window.write(position, states if keep is None else states[:, keep])

    def rollback(self, batch: Batch) -> None:
        rollback(self.cache, self.round_length - 1)

    def close(self) -> None:
        self.recorder.close()

    def timed_step(self, batch: Batch) -> None:
        start = self.cache.get_seq_length()
        inputs = batch.model_inputs(start, start + 1)
        states = self.recorder.latest[:, -1:]  # the target's latest states: the values do not change the cost
        self.model(batch.seq[:, start + 1 : start + 2], states, inputs["position_ids"], True, self.cache,
                   inputs["attention_mask"], logits_to_keep=1)
        rollback(self.cache, start)

    def tree_root(self, batch: Batch):
        length = self.round_length = batch.length
        start = self.cache.get_seq_length()
        inputs = batch.model_inputs(start, length - 1)
        out, logits = self.model(batch.seq[:, start + 1 : length], self.window.read(start, length - 1),
                                 inputs["position_ids"], True, self.cache, inputs["attention_mask"], logits_to_keep=1)
        return self.log_probs(logits[0, -1]), out[0, -1:]

    def tree_step(self, tokens, parent_states, depths, allowed):
        # A node at depth d is fed at draft position L - 2 + d (a round's j-th proposal is fed at L - 2 + j).
        device = self.model.device
        positions = torch.tensor(depths, device=device)[None] + self.round_length - 2
        out, logits = self.model(tokens[None].to(device), parent_states[None], positions, False, self.cache,
                                 tree_mask=allowed)
        return self.log_probs(logits[0]), out[0]

    def tree_rollback(self) -> None:
        rollback(self.cache, self.round_length - 1)

    def propose(self, batch: Batch, k: int, generator, stats):
        length = self.round_length = batch.length
        start = self.cache.get_seq_length()
        ids, hidden, from_target = batch.seq[:, start + 1 : length], self.window.read(start, length - 1), True
        inputs = batch.model_inputs(start, length - 1)
        tokens, qs = [], []
        for j in range(k):
            out, logits = self.model(ids, hidden, inputs["position_ids"], from_target, self.cache,
                                     inputs["attention_mask"], logits_to_keep=1)
            stats.draft_forwards += 1
            token = self.pick(logits, batch, generator, qs)
            tokens.append(token)
            batch.seq[:, length + j] = token
            ids, hidden, from_target = token[:, None], out[:, -1:], False
            inputs = batch.model_inputs(length - 1 + j, length + j)
        return torch.stack(tokens, dim=1), (torch.stack(qs, dim=1) if qs else None)
