"""Prompts written by the target itself, for users without a prompt set in their domain (`prompts: self:N`).

An instruct model given its chat template only up to where a user's message begins writes a plausible user
request, then ends the turn. Sampling that many times gives prompts from the model's own idea of its users, the
method of Magpie (Xu et al. 2024, arXiv:2406.08464). Distilling on the target's answers to them widens the
topics a draft sees beyond a templated or narrow prompt set.

Kept: requests that end their turn within `self_prompt_max_tokens`, are at least MIN_CHARS long, are not
degenerate repetition, and are new (case and spacing ignored). They are written after every batch to
`<output_dir>/self_prompts-<hash>.jsonl`, the hash of the settings that shape them. Batch b samples from a
generator seeded by (seed, b), so an interrupted run continues where it stopped and produces what an
uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdec import SamplingConfig, target_generate
from specdec.models import load_model, load_tokenizer
from specdec.tokens import eos_ids

log = logging.getLogger(__name__)

MIN_CHARS = 12
_REPEATED_WORD = re.compile(r"\b(\w+)\b(?:\W+\1\b){3,}", re.IGNORECASE)  # the same word 4+ times in a row
_MARK = "\u0000SPECDEC_USER_TURN\u0000"


def count_from(source: str) -> int | None:
    """N for a prompt source 'self:N', else None (ValueError on a malformed N)."""
    if not source.startswith("self:"):
        return None
    text = source[len("self:"):]
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"prompts={source!r}: write self:N with N a positive number of prompts, e.g. self:1500")
    return int(text)


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's first message begins (its default system turn too)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("prompts=self:N needs a target whose tokenizer has a chat template (an instruct model)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=False)
    return tokenizer(text[:text.index(_MARK)], add_special_tokens=False).input_ids


def usable(text: str) -> bool:
    return len(text) >= MIN_CHARS and not _REPEATED_WORD.search(text)


def path_for(cfg, out_dir: Path) -> Path:
    """The prompt file of these settings: another target, seed or sampling setting writes another file."""

    keys = ("target", "seed", "dtype", "batch_size", "self_prompt_temperature", "self_prompt_top_p",
            "self_prompt_max_tokens")
    digest = hashlib.sha256(json.dumps([getattr(cfg, k) for k in keys]).encode()).hexdigest()[:10]
    return out_dir / f"self_prompts-{digest}.jsonl"


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.replace(tmp, path)  # a crash leaves the previous complete file


def generate(cfg, n: int, out_dir: Path, device=None) -> Path:
    """Make sure `out_dir/self_prompts.jsonl` holds n prompts written by cfg.target; returns its path."""


    path = path_for(cfg, out_dir)
    rows = _read(path)
    if len(rows) >= n:
        return path
    tokenizer = load_tokenizer(cfg.target)
    prefix = user_turn_prefix(tokenizer)
    model = load_model(cfg.target, dtype=cfg.dtype, device=device if device is not None else cfg.device)
    device = next(model.parameters()).device
    eos = eos_ids(model, tokenizer)
    if not eos:
        raise ValueError("prompts=self:N needs the target's end-of-turn token (eos_token_id); none is set")
    sampling = SamplingConfig(temperature=cfg.self_prompt_temperature, top_p=cfg.self_prompt_top_p)
    seen = {" ".join(r["turns"][0].lower().split()) for r in rows}
    batch = max((r["batch"] for r in rows), default=-1) + 1
    ids = torch.tensor([prefix] * cfg.batch_size, device=device)
    bar = tqdm(total=n, initial=len(rows), desc="self prompts", unit="prompt")
    out_dir.mkdir(parents=True, exist_ok=True)
    tried = 0
    while len(rows) < n:
        generator = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + batch)
        out = target_generate(model, ids, sampling=sampling, max_new_tokens=cfg.self_prompt_max_tokens,
                              eos_token_id=eos, generator=generator, drop_finished=True)
        for row_index, row in enumerate(out.sequences[:, len(prefix):].tolist()):
            tried += 1
            ended = [i for i, t in enumerate(row) if t in eos]
            if not ended or len(rows) >= n:
                continue  # ran past the token budget: a cut-off request is not a prompt
            text = tokenizer.decode(row[:ended[0]], skip_special_tokens=True).strip()
            key = " ".join(text.lower().split())
            if usable(text) and key not in seen:
                seen.add(key)
                rows.append({"prompt_id": f"self-{cfg.seed}-{batch}-{row_index}", "category": "self",
                             "turns": [text], "batch": batch})
                bar.update(1)
        _write(path, rows)
        batch += 1
        if batch > 20 and len(rows) < 0.01 * tried:
            raise ValueError(f"only {len(rows)} usable prompts from {tried} samples: {cfg.target} does not write "
                             f"user requests from its chat template; pass a prompt file instead")
    bar.close()
    log.info("self prompts: %d kept of %d sampled -> %s", len(rows), tried, path)
    return path
