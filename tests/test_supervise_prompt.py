"""supervise_prompt: the prompts' positions scored too (the online teacher reads the target's distribution there),
the held-out figures still over completions only."""

import json

import pytest

from specdec.train import batches
from specdec.train.train_config import TrainConfig

LAYERS = [1, 2, 3]


def test_collate_scores_every_position_of_the_sample_with_prompt_positions():
    rows = {"input_ids": [[5, 6, 7, 8, 9, 10], [5, 6, 7]], "prompt_length": [4, 2]}
    completions = batches.collate(rows, pad_id=0, max_length=16)
    everything = batches.collate(rows, pad_id=0, max_length=16, prompt_positions=True)
    # logits position t predicts token t + 1: completions from prompt - 1, every token but the first with the flag
    assert completions["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0], [0, 1, 0, 0, 0, 0]]
    assert everything["loss_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]]
    assert everything["n_tokens"] - completions["n_tokens"] == (4 - 1) + (2 - 1)


def scored_predictions(batch, rows, prompt_only: bool = False) -> list[tuple]:
    """Each scored position (or only those that predict a prompt token) as what it is trained on: the tokens it
    reads and the token it predicts."""
    return [tuple(ids[:t + 2]) for b, ids in enumerate(rows["input_ids"])
            for t in range(rows["prompt_length"][b] - 1 if prompt_only else len(ids) - 1) if batch["loss_mask"][b, t]]


def test_prompt_positions_are_scored_once_whichever_rows_repeat_them():
    """A shared opening (a system prompt), a prompt's second answer and a conversation's second turn repeat
    prompt positions of earlier rows: with their shared prefixes each of those predictions is scored in exactly
    one row, none is lost, and every row's completion is scored as before."""
    import datasets

    opening, ask, other = [1, 2, 3], [40, 41, 42], [50, 51]
    first = opening + ask + [7, 8, 9]                 # prompt A, first answer
    rows = {"prompt_id": ["A", "A", "A", "B", "A"],
            "sample_index": [0, 1, 0, 0, 1],
            "turn": [0, 0, 1, 0, 1],
            "prompt_length": [6, 6, 11, 5, 11],
            "input_ids": [first,
                          opening + ask + [7, 5],      # A's second answer: the same prompt, another completion
                          first + [60, 61] + [8, 8],    # A's second turn: the first turn's row, a new ask, an answer
                          opening + other + [9, 9, 9],  # prompt B: only the opening is shared
                          opening + ask + [7, 5] + [60, 61] + [6]]}  # the second answer's second turn
    shared = batches.shared_prefixes(datasets.Dataset.from_dict(rows), max_length=64)
    assert shared.tolist() == [0, 6, 9, 3, 8]
    plain = batches.collate(rows, pad_id=0, max_length=64, prompt_positions=True)
    once = batches.collate(rows, pad_id=0, max_length=64, prompt_positions=True, shared=shared.tolist())
    everything, kept = scored_predictions(plain, rows), scored_predictions(once, rows)
    assert set(kept) == set(everything)  # none lost
    repeated = [p for p in scored_predictions(plain, rows, prompt_only=True) if everything.count(p) > 1]
    assert repeated  # without them, rows score each other's prompt positions again
    assert all(kept.count(p) == 1 for p in scored_predictions(once, rows, prompt_only=True))  # with them, once
    # rows in another order (a second answer first): still each once, none lost
    order = [1, 4, 2, 0, 3]
    moved = {key: [column[i] for i in order] for key, column in rows.items()}
    moved_shared = batches.shared_prefixes(datasets.Dataset.from_dict(moved), max_length=64).tolist()
    moved_once = batches.collate(moved, 0, 64, prompt_positions=True, shared=moved_shared)
    kept = scored_predictions(moved_once, moved)
    assert set(kept) == set(everything)
    assert all(kept.count(p) == 1 for p in scored_predictions(moved_once, moved, prompt_only=True))
    completions = batches.collate(rows, pad_id=0, max_length=64)["loss_mask"]
    assert (once["loss_mask"] & completions).equal(completions)


@pytest.mark.parametrize(("changes", "message"), [
    ({"teacher": "offline"}, "teacher=offline lacks"),
    ({"teacher": "on_policy"}, "teacher=on_policy"),
])
def test_supervise_prompt_refuses_teachers_without_the_prompts_distribution(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(supervise_prompt=True, **changes)
    TrainConfig(supervise_prompt=True, teacher="offline", loss="ce")  # hard labels need no teacher


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_eagle3_trains_on_prompt_positions_and_scores_held_out_completions_only(tmp_path, monkeypatch):
    """A recorded-states EAGLE-3 run with supervise_prompt: its training batches score the prompts' positions (more
    than the completions alone), its held-out replay scores the same positions as a run without it."""
    from conftest import save_tiny_world

    from specdec.train import distill
    from specdec.train.data import DataConfig
    from specdec.train.data import run as run_data

    ws = save_tiny_world(tmp_path / "ws", target_layers=4, small_seed=7, n_train=2, n_heldout=2)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"explain the sum of {w} and water"}) + "\n"
                               for w in "a city book list food number simple clear water the".split()))
    for folder, limit in (("recorded", None), ("recorded_heldout", 3)):
        run_data(DataConfig(target=str(ws / "target"), prompts=str(prompts), output_dir=str(tmp_path / folder),
                            max_new_tokens=8, batch_size=4, dtype="float32", device="cpu", limit=limit,
                            record_features=True, eagle_aux_layer_ids=LAYERS))
    scored, skipped = [], []
    collate = batches.collate

    def counting_collate(rows, pad_id, max_length, prompt_positions=False, multiple=1, shared=None):
        out = collate(rows, pad_id, max_length, prompt_positions, multiple, shared)
        scored.append((prompt_positions, out["n_tokens"]))
        if prompt_positions:  # the trainer passes each row's shared prefix: every row but one skips the opening
            skipped.append(sorted(shared) if shared is not None else None)
        return out

    monkeypatch.setattr(batches, "collate", counting_collate)
    runs = {}
    for flag in (False, True):
        cfg = TrainConfig(target=str(ws / "target"), train_data=str(tmp_path / "recorded"),
                          heldout_data=str(tmp_path / "recorded_heldout"), output_dir=str(tmp_path / f"run{flag}"),
                          device="cpu", draft="eagle3", teacher="online", ttt_steps=2, eagle_aux_layer_ids=LAYERS,
                          max_steps=2, per_device_batch_size=4, warmup_steps=0, eval_every=0, save_every=0,
                          eval_samples=3, learning_rate=3e-3, data_workers=0, supervise_prompt=flag)
        scored.clear()
        distill.run(cfg)
        runs[flag] = [n for f, n in scored if f == flag]
        history = [json.loads(line) for line in (tmp_path / f"run{flag}" / "eval.jsonl").read_text().splitlines()]
        runs[flag, "heldout"] = history[-1]["positions"]
    assert len(runs[True]) == len(runs[False]) == 2  # one micro-batch per step, the same rows in the same order
    assert all(a > b for a, b in zip(runs[True], runs[False]))
    assert runs[True, "heldout"] == runs[False, "heldout"] > 0
    assert skipped and all(shared is not None and shared[-1] > 1 for shared in skipped)  # the chat template's opening
