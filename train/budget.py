"""A training time budget (`max_minutes`): training stops by then, its learning-rate schedule re-aimed so that
the cosine decay still ends at the last step taken.

A step count fixed in a recipe takes twice as long on a machine half as fast; a budget in minutes does not.
The pace is measured as training goes (evaluations and the first epoch's feature caching included), and the
end step is re-estimated at every log step: min(max_steps, steps the remaining time allows at that pace), with
the last evaluation's duration held back for the final one. The schedule's end moves with it, so the learning
rate follows the cosine to (near) zero at the step training actually stops, instead of being cut mid-decay.
"""

from __future__ import annotations

import math
import time


def check_minutes(minutes: float | None) -> None:
    """A `max_minutes` setting is > 0 or unset (None: no time limit)."""
    if minutes is not None and minutes <= 0:
        raise ValueError(f"max_minutes must be > 0 (or unset for no time limit), got {minutes}")


class CosineToEnd:
    """Linear warm-up then cosine decay to zero at `end`: transformers' get_cosine_schedule_with_warmup, with an
    end that may move. A callable object (not a function), so LambdaLR's state_dict saves `end` with the run's
    checkpoints and a resumed run keeps the end it had reached."""

    def __init__(self, warmup_steps: int, end: int):
        self.warmup_steps, self.end = warmup_steps, end

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / max(1, self.warmup_steps)
        progress = (step - self.warmup_steps) / max(1, self.end - self.warmup_steps)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


class LinearToEnd(CosineToEnd):
    """Linear warm-up then linear decay to zero at `end` (transformers' get_linear_schedule_with_warmup, the
    schedule speculators' trainer uses), with the same movable end."""

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / max(1, self.warmup_steps)
        progress = (step - self.warmup_steps) / max(1, self.end - self.warmup_steps)
        return max(0.0, 1.0 - min(progress, 1.0))


SCHEDULES = {"cosine": CosineToEnd, "linear": LinearToEnd}  # TrainConfig.lr_schedule


class TimeBudget:
    """Wall time of one training run, summed over resumes, against `minutes`."""

    def __init__(self, minutes: float, max_steps: int, spent_seconds: float = 0.0, clock=time.perf_counter):
        check_minutes(minutes)
        self.seconds, self.max_steps, self.clock = minutes * 60.0, max_steps, clock
        self.before = spent_seconds  # spent by earlier runs of this training (resume)
        self.started = clock()
        self.loop_started: float | None = None
        self.loop_first_step = 0
        self.last_eval_seconds = 0.0

    def resume(self, spent_seconds: float) -> None:
        """Count the seconds that earlier runs of this training spent (from the checkpoint resumed)."""
        self.before = spent_seconds

    def spent(self) -> float:
        """Seconds of this training so far, earlier runs included."""
        return self.before + self.clock() - self.started

    def start_loop(self, step: int) -> None:
        """Training steps start after `step` (0, or the step resumed from): the pace is measured from here."""
        self.loop_started, self.loop_first_step = self.clock(), step

    def note_eval(self, seconds: float) -> None:
        self.last_eval_seconds = seconds

    def end_step(self, step: int) -> int:
        """The step to stop at, seen from `step`: as many more as the time left allows at the pace so far, less
        a final evaluation as long as the last one; never beyond max_steps, never before `step`."""
        done = step - self.loop_first_step
        if self.loop_started is None or done <= 0 or math.isinf(self.seconds):
            return self.max_steps
        pace = (self.clock() - self.loop_started) / done
        left = self.seconds - self.spent() - self.last_eval_seconds
        return max(step, min(self.max_steps, step + math.floor(left / pace)))
