"""A CPU training run gives its heap's freed pages back every release_host_memory_every steps
(train/host_memory.py): the call really returns memory, the trainer makes it on the steps the key names, and a bad
value is refused."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_world

from specdec.train import distill, host_memory
from specdec.train.train_config import TrainConfig

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _anon_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024
    pytest.skip("no RssAnon in /proc/self/status")


def test_heap_trim_returns_freed_heap_pages():
    trim = host_memory.heap_trim()
    if trim is None:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    # Blocks under glibc's mmap threshold come from the heap; the last one, kept, pins the heap's top, so freeing
    # the others leaves their pages resident until trimmed.
    blocks = [torch.ones(16 * 1024) for _ in range(4000)]  # 64 KiB each, 250 MiB in all
    kept = blocks[-1]
    del blocks
    before = _anon_mb()
    trim()
    assert before - _anon_mb() > 100, "malloc_trim gave back less than 100 MB of 250 MB freed"
    del kept  # held until after the trim


def test_the_trainer_trims_on_the_steps_named(tmp_path, monkeypatch):
    ws = save_tiny_world(tmp_path / "world", target_layers=2, small_seed=7, n_train=24, n_heldout=6)
    stepped, trimmed = [], []
    train_step = distill.Distiller.train_step

    def counted(self, step, micro_batches):
        stepped.append(step)
        return train_step(self, step, micro_batches)

    monkeypatch.setattr(distill.Distiller, "train_step", counted)
    monkeypatch.setattr(host_memory, "heap_trim", lambda: lambda: trimmed.append(stepped[-1]))
    base = dict(target=str(ws / "target"), train_data=str(ws / "data"), heldout_data=str(ws / "heldout"),
                device="cpu", draft_layers=[0], max_steps=7, per_device_batch_size=4, warmup_steps=1,
                eval_every=0, save_every=0, eval_samples=6, eval_batch_size=3)
    distill.run(TrainConfig(**base, output_dir=str(tmp_path / "every3"), release_host_memory_every=3))
    assert trimmed == [3, 6]
    trimmed.clear()
    distill.run(TrainConfig(**base, output_dir=str(tmp_path / "never"), release_host_memory_every=0))
    assert trimmed == []


def test_a_negative_period_is_refused():
    with pytest.raises(ValueError, match="release_host_memory_every must be >= 0"):
        TrainConfig(release_host_memory_every=-1)
