"""The training time budget (train/budget.py): the schedule it re-aims and the end step it computes."""

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from specdec.train.budget import CosineToEnd, TimeBudget


def _lrs(scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def test_a_fixed_end_is_transformers_cosine_schedule_with_warmup():
    ours = torch.optim.lr_scheduler.LambdaLR(opt := _optimizer(), CosineToEnd(5, 40))
    theirs = get_cosine_schedule_with_warmup(_optimizer(), 5, 40)
    assert _lrs(ours, 41) == pytest.approx(_lrs(theirs, 41))
    assert _lrs(ours, 5) == [0.0] * 5  # past the end it stays at zero (transformers' rises again)
    assert opt.param_groups[0]["lr"] == 0.0


def test_the_end_is_saved_with_the_scheduler_and_restored_on_resume():
    scheduler = torch.optim.lr_scheduler.LambdaLR(_optimizer(), CosineToEnd(2, 100))
    scheduler.lr_lambdas[0].end = 37
    resumed = torch.optim.lr_scheduler.LambdaLR(_optimizer(), CosineToEnd(2, 100))
    resumed.load_state_dict(scheduler.state_dict())
    assert resumed.lr_lambdas[0].end == 37


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_end_step_is_what_the_time_left_allows_at_the_measured_pace():
    clock = _Clock()
    budget = TimeBudget(minutes=1.0, max_steps=1000, clock=clock)
    clock.now = 10.0  # loading and the first evaluation
    budget.start_loop(0)
    assert budget.end_step(0) == 1000  # no pace measured yet
    clock.now = 30.0  # 10 steps in 20 s: 2 s a step, 30 s left of 60
    budget.note_eval(4.0)  # the final evaluation will take about as long as the last one
    assert budget.end_step(10) == 10 + (60 - 30 - 4) // 2
    clock.now = 100.0
    assert budget.end_step(12) == 12  # over time: stop now, never before the current step
    assert TimeBudget(minutes=60.0, max_steps=50, clock=clock).end_step(0) == 50


def test_resumed_runs_count_the_time_spent_before():
    clock = _Clock()
    budget = TimeBudget(minutes=1.0, max_steps=1000, spent_seconds=50.0, clock=clock)
    budget.start_loop(100)
    clock.now = 5.0  # 5 steps in 5 s: 55 s spent, 5 s left
    assert budget.spent() == 55.0 and budget.end_step(105) == 110


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError, match="max_minutes must be > 0"):
        TimeBudget(minutes=0, max_steps=10)
