"""Shared fixtures: seeded tiny random Llama models built from config (no downloads)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Tiny models run fastest on one thread (and 2 OpenMP threads spin badly on a loaded 2-core machine).
torch.set_num_threads(1)


def tiny_llama(seed: int = 0, vocab_size: int = 128, layers: int = 2, hidden: int = 32,
               dtype: torch.dtype = torch.float64, max_positions: int = 256) -> LlamaForCausalLM:
    """A seeded random LlamaForCausalLM; float64 by default so that argmax ties between batched and
    one-token forwards (different GEMM shapes) cannot flip a greedy token."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    # Random init gives near-uniform logits; a larger head spreads them so decoding is not a coin toss.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def draft():
    return tiny_llama(seed=1, layers=1)


def ragged_prompts(batch: int, vocab: int, seed: int, min_len: int = 3, max_len: int = 9):
    """Left-padded random prompts of different lengths: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=g).tolist()
    width = max(lengths)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


# --- tiny tokenizer (data helper) -------------------------------------------------------------------------
_TINY_WORDS = (
    "the a an of to and is in it that for on with as are be this was by at or from what how why when where "
    "which who explain write describe list give make tell find show help plan short long story poem code "
    "python function number numbers sum add two three four five ten day week year time people city water "
    "food book list email letter summary simple clear step steps first then next last good bad new old "
    "small big fast slow question answer word words sentence please can you i we they my your our"
).split()
TINY_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer(chat_template: bool = True):
    """A word-level tokenizer over a 128-entry vocabulary (pad 0, bos 1, eos 2, unk 3), matching tiny_llama."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = TINY_SPECIALS + [w for w in dict.fromkeys(_TINY_WORDS) if w not in TINY_SPECIALS]
    words += [f"w{i}" for i in range(128 - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>")
    if chat_template:
        out.chat_template = TINY_CHAT_TEMPLATE
    return out


@pytest.fixture(scope="session")
def tiny_tok():
    return tiny_tokenizer()


# --- generated distillation data (trainer helper) ---------------------------------------------------------
def write_generated_data(folder, target, n_prompts: int, seed: int, completion: int = 8, topn: int = 4,
                         vocab: int = 128) -> None:
    """A `specdec data`-shaped folder (manifest.json + shards/*.parquet): `target`'s greedy completions of
    random prompts, with its top-`topn` log-probs at each completion position."""
    import json
    from pathlib import Path

    from datasets import Dataset

    folder = Path(folder)
    g = torch.Generator().manual_seed(seed)
    keys = ("prompt_id", "category", "sample_index", "turn", "input_ids", "prompt_length", "top_ids", "top_logprobs")
    rows = {k: [] for k in keys}
    with torch.no_grad():
        for i in range(n_prompts):
            ids = torch.randint(7, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            prompt_length, tops, lps = len(ids), [], []
            for _ in range(completion):
                logp = target(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
                top = logp.topk(topn)
                tops.append(top.indices.tolist())
                lps.append(top.values.tolist())
                ids.append(int(top.indices[0]))
            values = (f"p{seed}-{i}", "test", 0, 0, ids, prompt_length, tops, lps)
            for key, value in zip(keys, values):
                rows[key].append(value)
    (folder / "shards").mkdir(parents=True)
    Dataset.from_dict(rows).to_parquet(str(folder / "shards" / "shard-00000.parquet"))
    manifest = {"format": "specdec-data/1", "complete": True, "num_shards": 1,
                "shards": [{"index": 0, "file": "shards/shard-00000.parquet", "examples": n_prompts}]}
    (folder / "manifest.json").write_text(json.dumps(manifest))


# --- tiny saved checkpoints and a prompt file (eval helper) -----------------------------------------------
TINY_EVAL_PROMPTS = [
    {"question_id": 1, "category": "writing", "turns": ["write a short story about the city", "make it long"]},
    {"question_id": 2, "category": "writing", "turns": ["write a poem for my day"]},
    {"question_id": 3, "category": "math", "turns": ["what is the sum of two and three numbers"]},
    {"question_id": 4, "category": "math", "turns": ["explain how to add ten numbers step by step please"]},
]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Saved tiny target and draft checkpoints (float64, the tiny tokenizer) and a Spec-Bench prompt file:
    {"target": path, "draft": path, "prompts": path}."""
    import json

    from specdec.models import save_model

    root = tmp_path_factory.mktemp("tiny_ckpt")
    tok = tiny_tokenizer()
    paths = {"target": root / "target", "draft": root / "draft", "prompts": root / "prompts.jsonl"}
    save_model(tiny_llama(seed=0), tok, paths["target"])
    save_model(tiny_llama(seed=1, layers=1), tok, paths["draft"])
    paths["prompts"].write_text("".join(json.dumps(r) + "\n" for r in TINY_EVAL_PROMPTS))
    return {k: str(v) for k, v in paths.items()}


# --- the public Spec-Bench prompt set, where a shared/ folder beside the checkout holds it (tests skip without) ---
def _spec_bench_path():
    from pathlib import Path

    return Path(__file__).resolve().parents[2] / "shared" / "data" / "specbench_mtbench.jsonl"


SPEC_BENCH = _spec_bench_path()
needs_spec_bench = pytest.mark.skipif(not SPEC_BENCH.is_file(), reason="the Spec-Bench prompt file is not beside "
                                      "the checkout (shared/data/specbench_mtbench.jsonl)")


def save_tiny_world(root, target_layers: int, small_seed: int, n_train: int, n_heldout: int):
    """A tiny target and a pretrained tiny draft saved as checkpoints with the tiny tokenizer, plus
    `specdec data`-shaped train and held-out folders generated by the target; returns root."""
    target = tiny_llama(seed=0, layers=target_layers, dtype=torch.float32)
    tok = tiny_tokenizer()
    for name, model in (("target", target), ("small", tiny_llama(seed=small_seed, layers=1, dtype=torch.float32))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    write_generated_data(root / "data", target, n_train, seed=1)
    write_generated_data(root / "heldout", target, n_heldout, seed=2)
    return root


@pytest.fixture
def fresh_accelerate_state():
    """Each in-process training run builds its own Accelerator (its state is a process-wide singleton)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()


def kill_data_run_after(args: list[str], env: dict, out: Path, shards: int, timeout: float, poll: float) -> None:
    """Start `python -m specdec.train.data ARGS` and SIGKILL it once its manifest lists `shards` finished shards (it
    must still be running then, else its stderr is shown)."""
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "specdec.train.data", *args], cwd=repo, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + timeout
        while time.time() < deadline and proc.poll() is None:
            manifest = out / "manifest.json"
            if manifest.is_file() and len(json.loads(manifest.read_text())["shards"]) >= shards:
                break
            time.sleep(poll)
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
