"""The parallel kind's terms of the memory plan (train/plan/kind.py: `KindPlan`): plain's (its draft is a plain one),
with the activations of PARD's layout, k times the sequence, and its explicit [kL, kL] attention mask."""

from __future__ import annotations

import dataclasses

from specdec.train.kinds.plain_plan import plain_plan
from specdec.train.parallel_train import BaseDraftConfig
from specdec.train.plan.activations import plain_activations
from specdec.train.plan.kind import KindPlan, PlanContext
from specdec.train.plan.report import Term
from specdec.train.plan.target import Widths, text_config


def parallel_plan(ctx: PlanContext) -> KindPlan:
    cfg = ctx.cfg
    copies, base = cfg.options.parallel_tokens, BaseDraftConfig(cfg, cfg.options.parallel_base)
    plan = plain_plan(dataclasses.replace(ctx, cfg=base))
    b, s = cfg.per_device_batch_size, cfg.max_length
    dw, layers = Widths.of(plan.model.config), text_config(plan.model.config).num_hidden_layers
    acts = plain_activations(b, copies * s, dw, layers, ctx.draft_vocab, ctx.half, cfg.loss)
    mask = b * (copies * s) ** 2 * (2 if ctx.half else 4) * 2  # the additive mask and its boolean source
    fix = ctx.activation_fix(f", parallel_tokens (now {copies})")
    plan.activation_fix = fix
    plan.step = [term for term in plan.step if term.name != "activations"]
    plan.step.insert(0, Term("activations", acts["peak"] + mask,
                             f"B={b}, S={s} x {copies} copies (PARD's layout), draft vocab {ctx.draft_vocab}", fix))
    return plan
