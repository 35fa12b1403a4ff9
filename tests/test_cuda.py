"""The same guarantees on a CUDA GPU (skipped where there is none): greedy and sampled exactness of the decoder,
the trainer under bf16 autocast through its real entry points (`python -m specdec.train`, `accelerate launch` with
the single-GPU and FSDP recipes), and `specdec eval`'s device figures.

CI has no GPU; these run wherever one is present (`pytest tests/test_cuda.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ragged_prompts, save_tiny_world, tiny_llama
from test_sampling_exact import ALPHA, PROMPTS, SETTINGS, VOCAB, combined_p, sample_counts
from test_train import _env

from specdec import speculative_generate, target_generate
from specdec.cli import main as specdec_main
from specdec.vocab import apply_reduced_head

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")
ROOT = Path(__file__).resolve().parents[1]


def _on_cuda(*models):
    return [m.to(CUDA) for m in models]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("batch,k", [(1, 1), (1, 4), (3, 4), (3, 7)])
def test_greedy_on_cuda_equals_target_alone(dtype, batch, k):
    target, draft = _on_cuda(tiny_llama(seed=0, dtype=dtype), tiny_llama(seed=1, layers=1, dtype=dtype))
    near = tiny_llama(seed=0, dtype=dtype)  # a noisy copy: long accepted runs, cache rollback on the GPU
    with torch.no_grad():
        for param in near.parameters():
            param.mul_(1 + 0.05 * torch.randn_like(param))
    near = near.to(CUDA)
    ids, mask = (t.to(CUDA) for t in ragged_prompts(batch, 128, seed=batch + k))
    ref = target_generate(target, ids, mask, max_new_tokens=40)
    for d in (draft, near):
        out = speculative_generate(target, d, ids, mask, num_draft_tokens=k, max_new_tokens=40)
        assert torch.equal(out.sequences, ref.sequences)
        assert not out.stats.fallback
    assert out.stats.acceptance_rate > 0.3


@pytest.mark.parametrize("tree", ["3x1x1", "dyn8"])
def test_draft_trees_on_cuda_are_exact(tree):
    from specdec.eagle3 import Eagle3Draft

    target = tiny_llama(seed=0).to(CUDA)
    near = tiny_llama(seed=0)
    with torch.no_grad():
        for param in near.parameters():
            param.mul_(1 + 0.3 * torch.randn_like(param))
    eagle = Eagle3Draft.from_target(target.cpu(), [1], seed=3).to(CUDA)
    target = target.to(CUDA)
    ids = torch.tensor([[3, 4, 5, 6, 7]], device=CUDA)
    ref = target_generate(target, ids, max_new_tokens=30)
    for d in (near.to(CUDA), eagle):
        out = speculative_generate(target, d, ids, max_new_tokens=30, tree=tree)
        assert torch.equal(out.sequences, ref.sequences) and not out.stats.fallback
    small = tiny_llama(seed=0, vocab_size=VOCAB, hidden=16, dtype=torch.float32).to(CUDA)
    g = torch.Generator(device=CUDA).manual_seed(0)
    out = speculative_generate(small, small, torch.tensor([[3, 4, 5]], device=CUDA), sampling=SETTINGS[0],
                               max_new_tokens=8, generator=g, tree=tree)
    assert out.sequences.shape[1] == 11 and not out.stats.fallback


def test_reduced_vocabulary_draft_on_cuda_is_exact():
    target = tiny_llama(seed=0).to(CUDA)
    reduced = apply_reduced_head(tiny_llama(seed=1, layers=1), torch.arange(0, 128, 3)).to(CUDA)
    ids, mask = (t.to(CUDA) for t in ragged_prompts(3, 128, seed=5))
    ref = target_generate(target, ids, mask, max_new_tokens=30)
    out = speculative_generate(target, reduced, ids, mask, num_draft_tokens=3, max_new_tokens=30)
    assert torch.equal(out.sequences, ref.sequences)


def test_eagle3_draft_on_cuda_is_exact_and_replays_its_rounds():
    """An EAGLE-3 draft fitted on the GPU: exact on ragged batches, and its replayed runs (the trainer's held-out
    figures) equal the decoder's rounds there too."""
    from test_eagle3 import FITTED_PROMPTS, fitted_draft

    from specdec.replay import replay_runs, target_states

    target = tiny_llama(seed=0, layers=4).to(CUDA)
    draft = fitted_draft(target.cpu(), steps=60).to(CUDA)
    target = target.to(CUDA)
    ids, mask = (t.to(CUDA) for t in ragged_prompts(3, 128, seed=5))
    ref = target_generate(target, ids, mask, max_new_tokens=30)
    out = speculative_generate(target, draft, ids, mask, num_draft_tokens=3, max_new_tokens=30)
    assert torch.equal(out.sequences, ref.sequences) and not out.stats.fallback
    prompt = FITTED_PROMPTS()[:1].to(CUDA)
    traced = speculative_generate(target, draft, prompt, num_draft_tokens=3, max_new_tokens=40, trace=True)
    seq = traced.sequences
    ones = torch.ones_like(seq)
    scored = torch.zeros_like(seq, dtype=torch.bool)
    scored[0, prompt.shape[1]: seq.shape[1] - 1] = True
    runs = replay_runs(draft, seq, ones, scored, 3, target_states(draft, target, seq, ones))[0]
    i = 0
    for r in traced.trace[:-1]:  # the last round may be cut by max_new_tokens
        assert int(r.num_accepted[0]) == min(runs[i], 3)
        i += r.advanced


@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1.0", "t0.7-p0.9"])
def test_sampled_output_on_cuda_is_distributed_as_the_target(sampling):
    """The chi-square test of test_sampling_exact, on the GPU with a CUDA generator (ragged rows, k = 2)."""
    target, draft = _on_cuda(tiny_llama(seed=0, vocab_size=VOCAB, hidden=16, dtype=torch.float32),
                             tiny_llama(seed=1, vocab_size=VOCAB, hidden=16, layers=1, dtype=torch.float32))
    counts = sample_counts(target, draft, PROMPTS, sampling, k=2, calls=10, copies=2000, seed=5)
    assert combined_p(target, PROMPTS, sampling, counts) > ALPHA


# ---- the trainer on the GPU ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return save_tiny_world(tmp_path_factory.mktemp("cuda_train"), target_layers=2, small_seed=7, n_train=24,
                           n_heldout=6)


def _recipe(ws: Path, path: Path, out: Path, **train) -> Path:
    body = {"target": str(ws / "target"), "draft": "derived", "seed": 0, "output_dir": str(out), "device": "auto",
            "train": {"train_data": str(ws / "data"), "heldout_data": str(ws / "heldout"), "draft_layers": [0],
                      "mixed_precision": "auto", "max_steps": 4, "per_device_batch_size": 4, "warmup_steps": 1,
                      "log_every": 1, "eval_every": 2, "save_every": 2, "eval_samples": 6, "eval_batch_size": 3,
                      "learning_rate": 1e-2, **train}}
    path.write_text(yaml.safe_dump(body))
    return path


def _train(argv: list[str], out: Path) -> dict:
    proc = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "final" / "config.json").is_file() and (out / "best" / "config.json").is_file()
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["device"].startswith("cuda") and summary["mixed_precision"] == "bf16", summary
    return summary


@pytest.mark.parametrize("teacher", ["online", "offline", "on_policy"])
def test_python_dash_m_train_on_cuda_in_bf16_and_resume(world, tmp_path, teacher):
    out = tmp_path / "run"
    recipe = _recipe(world, tmp_path / "r.yaml", out, teacher=teacher, on_policy_fraction=0.5,
                     on_policy_max_new_tokens=4)
    assert _train([sys.executable, "-m", "specdec.train", "--config", str(recipe)], out)["steps"] == 4
    summary = _train([sys.executable, "-m", "specdec.train", "--config", str(recipe), "resume_from=latest",
                      "max_steps=6"], out)
    assert summary["steps"] == 6


@pytest.mark.parametrize("accelerate_config", ["single_gpu.yaml", "fsdp.yaml"])
def test_accelerate_launch_recipes_on_one_gpu(world, tmp_path, accelerate_config):
    out = tmp_path / "run"
    recipe = _recipe(world, tmp_path / "r.yaml", out)
    _train([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(ROOT / "recipes" / "accelerate" / accelerate_config), "--num_processes", "1",
            "-m", "specdec.train", "--config", str(recipe)], out)


# ---- eval on the GPU -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eval_on_cuda_reports_the_device_and_its_memory(tiny_checkpoints, tmp_path, dtype):
    assert specdec_main(["eval", "--target", tiny_checkpoints["target"], "--draft", tiny_checkpoints["draft"],
                         "--prompts", tiny_checkpoints["prompts"], "--max-new-tokens", "16", "--out",
                         str(tmp_path), f"dtype={dtype}", "device=cuda", "cost_repeats=2"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["environment"]["device"].startswith("cuda")
    assert report["baseline"]["peak_memory_mb"] > 0 and report["speculative"]["peak_memory_mb"] > 0
    # Printed for the device log: whether bf16 verification of k + 1 tokens kept greedy output identical.
    print(f"eval {dtype}: equivalence {report['equivalence']}, speedup {report['speedup']:.3f}")
    if dtype == "float32":
        assert report["equivalence"]["passed"]


def test_data_stage_with_self_written_prompts_on_cuda(tiny_checkpoints, tmp_path):
    from specdec.train import data as data_stage
    from specdec.train.data import DataConfig

    cfg = DataConfig(target=tiny_checkpoints["target"], prompts=f"{tiny_checkpoints['prompts']},self:5",
                     output_dir=str(tmp_path), batch_size=16, max_new_tokens=4, self_prompt_max_tokens=12,
                     self_prompt_temperature=1.0, top_logprobs=3, device="cuda", dtype="float32",
                     spec_bench_turns="first")
    manifest = data_stage.run(cfg)
    assert manifest["complete"] and manifest["counts"]["prompts"] == 4 + 5
