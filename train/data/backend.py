"""The backend interface: what the run loop needs of whatever makes a shard's rows, and the generation backends'
shared turn-by-turn loop.

    Backend              shard_rows(items, ...) -> (rows, counts); states_seconds; close()
      GenerationBackend  the target writes the answers: generator(seed), generate(prompts, generator) -> [Completion]
        TransformersBackend (backend_transformers.py), VLLMBackend (backend_vllm.py)
      DatasetBackend     responses=dataset: the conversations' own answers (backend_dataset.py)

A backend is chosen once per run (run_loop.make_backend); the run loop and the turn loop call only these methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, GenerationConfig

from specdec.prompts import encode_prompt
from specdec.sampling import SamplingConfig
from specdec.train.data.config import DataConfig
from specdec.train.data.features import FeatureSpool, keep_features
from specdec.train.data.planning import Item, turn_messages
from specdec.train.data.reasoning import assistant_message


@dataclass
class Completion:
    tokens: list[int]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # record_features: [prompt + len(tokens) - 1, W] bf16, the positions fed to the target; or a function that
    # loads them (a backend that holds a whole request's completions computes them as they are taken)
    features: Any = None

    def take_features(self) -> torch.Tensor:
        """The features, handed over: this completion holds them no longer."""
        features, self.features = self.features, None
        return features() if callable(features) else features


class Backend(ABC):
    """What the run loop needs of a backend: the rows of a shard's items (and their counts), and closing."""

    cfg: DataConfig

    @property
    def states_seconds(self) -> float | None:
        """Seconds so far of a prefill that computes the states apart from the answers (a share of the shards'
        seconds, for the manifest); None where the states, if any, come with the answers."""
        return None

    @abstractmethod
    def shard_rows(self, items: list[Item], tokenizer, seed: int, context_limit: int | None, progress=None,
                   features: FeatureSpool | None = None) -> tuple[list[dict], dict]:
        """The shard's rows in a deterministic order, and its counts (examples, generated_tokens, dropped_turns).
        With record_features each row's features go to `features` as they are made (kept on the rows without)."""

    def close(self) -> None:
        """Release what the backend holds beyond memory (an engine process, temporary files): here, nothing."""
        return


class GenerationBackend(Backend):
    """A backend where the target writes each answer: `generate_shard` feeds it a shard's turns."""

    eos: list[int]
    # Prompts per generate() call; None: all of a turn's prompts in one call (an engine that batches them itself).
    prompts_per_call: int | None

    def generator(self, seed: int) -> torch.Generator:
        """The shard's random stream, seeded by (seed, shard); passed to each of its generate() calls."""
        return torch.Generator().manual_seed(seed)

    @abstractmethod
    def generate(self, prompts: list[list[int]], generator: torch.Generator,
                 sampling: SamplingConfig | None = None) -> list[Completion]:
        """Completions of prompts (token lists of any lengths), in their order, sampled with `sampling` (None: the
        run's temperature / top_k / top_p)."""

    def shard_rows(self, items: list[Item], tokenizer, seed: int, context_limit: int | None, progress=None,
                   features: FeatureSpool | None = None) -> tuple[list[dict], dict]:
        return generate_shard(items, self, tokenizer, self.cfg, seed, context_limit, progress, features)


def _turn_prompts(items: list[Item], histories: list[list[dict]], active: list[int], turn: int, tokenizer,
                  cfg: DataConfig, context_limit: int | None, counts: dict) -> dict[int, list[int]]:
    """The encoded prompt of each active item's next turn; a conversation that outgrew the context is dropped."""
    prompts: dict[int, list[int]] = {}
    for i in active:
        histories[i].extend(turn_messages(items[i].user_turns[turn]))
        ids = encode_prompt(tokenizer, histories[i], cfg.use_chat_template, cfg.chat_template_kwargs,
                            items[i].prompt.tools)
        if turn > 0 and context_limit is not None and len(ids) + cfg.max_new_tokens > context_limit:
            counts["dropped_turns"] += len(items[i].user_turns) - turn
            continue  # its later turns are dropped
        prompts[i] = ids
    return prompts


def _completion_row(item: Item, turn: int, prompt: list[int], comp: Completion, cfg: DataConfig,
                    features: FeatureSpool | None) -> dict:
    row = {"prompt_id": item.prompt.prompt_id, "category": item.prompt.category or "",
           "sample_index": item.sample_index, "turn": turn, "input_ids": prompt + comp.tokens,
           "prompt_length": len(prompt)}
    if cfg.top_logprobs:
        row["top_ids"], row["top_logprobs"] = comp.top_ids, comp.top_logprobs
    if cfg.mixes_sampling:  # what this row was sampled at, for a per-temperature look at the data
        row["temperature"], row["top_p"] = item.temperature, item.top_p
    if cfg.record_features:  # beside the shard, not in it
        keep_features(row, comp.take_features(), features)
    return row


def _batches(order: list[int], prompts: dict[int, list[int]], rows: int | None, cfg: DataConfig) -> list[list[int]]:
    """`order` cut into generate() calls: at most `rows` prompts each (None: one call) and, for a backend that
    batches per call, at most cfg.batch_tokens padded positions, one prompt at least."""
    if rows is None:
        return [order] if order else []
    batches: list[list[int]] = []
    width = 0  # the last batch's padded width: its longest prompt + max_new_tokens
    for i in order:
        grown = max(width, len(prompts[i]) + cfg.max_new_tokens)
        if batches and len(batches[-1]) < rows and (
                not cfg.batch_tokens or (len(batches[-1]) + 1) * grown <= cfg.batch_tokens):
            batches[-1].append(i)
            width = grown
        else:
            batches.append([i])
            width = len(prompts[i]) + cfg.max_new_tokens
    return batches


def _item_sampling(item: Item, cfg: DataConfig) -> SamplingConfig | None:
    """The item's own sampling (temperatures / top_ps), None for the run's."""
    if item.temperature is None:
        return None
    return SamplingConfig(temperature=item.temperature, top_k=cfg.top_k, top_p=item.top_p)


def _by_sampling(order: list[int], items: list[Item]) -> list[list[int]]:
    """`order` split into runs of one sampling setting each (one generate() call samples with one setting)."""
    groups: dict[tuple, list[int]] = {}
    for i in order:
        groups.setdefault((items[i].temperature, items[i].top_p), []).append(i)
    return list(groups.values())


def generate_shard(items: list[Item], backend: GenerationBackend, tokenizer, cfg: DataConfig, seed: int,
                   context_limit: int | None, progress=None,
                   features: FeatureSpool | None = None) -> tuple[list[dict], dict]:
    """Rows for a shard's items, turn by turn (each turn sees the target's own earlier answers); and counts.
    With record_features each row's features go to `features` as its batch is done (kept on the rows without)."""
    generator = backend.generator(seed)
    histories = [list(it.history) for it in items]
    active = list(range(len(items)))
    rows: list[dict] = []
    counts = {"examples": 0, "generated_tokens": 0, "dropped_turns": 0}
    turn = 0
    while active:
        prompts = _turn_prompts(items, histories, active, turn, tokenizer, cfg, context_limit, counts)
        order = sorted(prompts, key=lambda i: -len(prompts[i])) if cfg.sort_by_length else list(prompts)
        chunks = [chunk for group in _by_sampling(order, items)
                  for chunk in _batches(group, prompts, backend.prompts_per_call, cfg)]
        for chunk in chunks:
            sampling = _item_sampling(items[chunk[0]], cfg)
            own = {"sampling": sampling} if sampling is not None else {}  # none: the run's, as before
            for i, comp in zip(chunk, backend.generate([prompts[i] for i in chunk], generator, **own)):
                rows.append(_completion_row(items[i], turn, prompts[i], comp, cfg, features))
                counts["examples"] += 1
                counts["generated_tokens"] += len(comp.tokens)
                # The next turn's history holds the answer as a server's parsers return it: thinking and tool
                # calls apart from the content, for the template to render (or drop) as it does when served.
                histories[i].append(assistant_message(tokenizer, comp.tokens))
                if progress is not None:
                    progress(1, len(comp.tokens))
        turn += 1
        active = [i for i in prompts if turn < len(items[i].user_turns)]
    # Deterministic row order inside a shard, whatever the batching was.
    order_of = {id(it): n for n, it in enumerate(items)}
    key = {(it.prompt.prompt_id, it.sample_index): order_of[id(it)] for it in items}
    rows.sort(key=lambda r: (key[(r["prompt_id"], r["sample_index"])], r["turn"]))
    return rows, counts


class CheckpointGenerationConfig:
    """Stands in for a model in eos_ids: the checkpoint's generation config, read without loading its weights."""

    def __init__(self, path: str):
        try:
            self.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: transformers derives one from config.json, as here
            self.generation_config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))
