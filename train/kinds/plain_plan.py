"""The plain kind's terms of the memory plan (train/plan/kind.py: `KindPlan`): its causal LM on the meta device
(derived, scratch or pretrained, a reduced head, frozen parts, LoRA), its activations, the online teacher's logits
and its held-out replay."""

from __future__ import annotations

import copy

import torch

from specdec.train.draft import DERIVED, SCRATCH, _resolve_layers, _subset_layer_config, kept_vocab_size
from specdec.train.plan.activations import plain_activations, target_forward_bytes
from specdec.train.plan.kind import KindPlan, PlanContext
from specdec.train.plan.report import Term
from specdec.train.plan.target import Widths, on_meta, text_config


def plain_plan(ctx: PlanContext) -> KindPlan:
    cfg, tw, b, s = ctx.cfg, ctx.tw, ctx.cfg.per_device_batch_size, ctx.cfg.max_length
    model, trainable = _draft_module(cfg, ctx.target_cfg, ctx.draft_vocab)
    dw, fix = Widths.of(model.config), ctx.activation_fix()
    acts = plain_activations(b, s, dw, text_config(model.config).num_hidden_layers, ctx.draft_vocab, ctx.half,
                             cfg.loss)
    plan = KindPlan(model, fix, _heldout_bytes(ctx), trainable=trainable,
                    frozen_note=": the target's embedding table" if cfg.freeze_embeddings else "",
                    target_why=f"teacher={cfg.teacher}",
                    target_fix="; teacher=offline (the data's stored top-n) needs no target on the device")
    plan.step.append(Term("activations", acts["peak"], f"B={b}, S={s}, draft vocab {ctx.draft_vocab}", fix))
    if cfg.teacher in ("online", "on_policy"):
        teacher = target_forward_bytes(b, s, tw, ctx.tbytes) + b * s * (ctx.tbytes * tw.vocab + 4 * ctx.draft_vocab)
        plan.step.append(Term("online teacher logits", teacher, "the target's forward and head, without grad",
                              "teacher=offline (stored top-n) or a lower per_device_batch_size / max_length"))
    return plan


def _draft_module(cfg, target_cfg, draft_vocab: int) -> tuple[torch.nn.Module, int | None]:
    """The draft as the trainer builds it, on the meta device, and its trainable count under LoRA."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.draft == DERIVED:
        chosen = _resolve_layers(cfg.draft_layers, text_config(target_cfg).num_hidden_layers)
        config = _subset_layer_config(target_cfg, chosen)
    elif cfg.draft == SCRATCH:
        config = copy.deepcopy(target_cfg)
        for key, value in cfg.draft_config.items():
            setattr(config, key, value)
    else:
        config = AutoConfig.from_pretrained(cfg.draft)
    model = on_meta(lambda: AutoModelForCausalLM.from_config(config))
    reduced = kept_vocab_size(cfg, draft_vocab)
    if reduced:
        head = model.get_output_embeddings()
        model.set_output_embeddings(on_meta(lambda: torch.nn.Linear(head.in_features, draft_vocab,
                                                                    bias=head.bias is not None)))
    if cfg.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    if cfg.freeze_head:
        model.get_output_embeddings().requires_grad_(False)
    if not cfg.lora:
        return model, None
    trainable = _lora_parameters(model, cfg.lora_r, cfg.lora_target_modules)
    if reduced:
        trainable += model.get_output_embeddings().weight.numel()
    model.requires_grad_(False)
    return model, trainable


def _lora_parameters(model, r: int, modules) -> int:
    return sum(r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in modules)


def _heldout_bytes(ctx: PlanContext) -> int:
    """The held-out replay's peak: the draft's logits and (online) the target's, with alpha's [rows, target
    vocabulary] blocks."""
    cfg, v, e = ctx.cfg, ctx.draft_vocab, ctx.tw.vocab
    b, s = cfg.eval_batch_size, cfg.max_length
    positions = b * s
    logits = positions * 8 * v
    alpha = positions * (16 * e + 12 * v) if cfg.needs_target else positions * (4 * e + 12 * v) if ctx.stored_topn else 0
    forward = target_forward_bytes(b, s, ctx.tw, ctx.tbytes) if cfg.needs_target else 0
    return logits + max(alpha, forward)
