"""How `specdec demo` splits its budget between data and training: by rates measured on this machine, so that
training sees its data `train_passes` times (the number that still pays, measured by bench/passes.py).

The demo generates one shard first. Its manifest gives the data stage's rate (examples per minute of generation);
a few training steps on that shard (a probe, thrown away: specdec/demo.py) give training's (samples per minute:
the trainer's `pace`). With N examples so far and R minutes left once the evaluation's estimate is set aside, d more minutes of
data and the rest for training meet the passes P when

    (R - d) * train_rate = P * (N + d * data_rate)   ->   d = (R * train_rate - P * N) / (train_rate + P * data_rate)

A machine whose data stage is slow against its trainer gives data the larger share, and the other way round;
a fixed share would be right for one machine only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Split:
    """The measured rates and the split they give."""

    data_rate: float  # examples per minute of generation (the manifest's shard seconds)
    train_rate: float  # samples per minute of training steps (the probe's pace)
    examples: int  # examples generated so far
    remaining: float  # minutes left for more data and training (budget - spent - the evaluation's estimate)
    passes: float  # passes over the data training should make

    def more_data_minutes(self) -> float:
        """Minutes of further data generation (0: the data so far already fills training's passes)."""
        more = (self.remaining * self.train_rate - self.passes * self.examples) / (
            self.train_rate + self.passes * self.data_rate)
        return min(max(0.0, more), self.remaining)

    def expected_examples(self) -> int:
        return round(self.examples + self.more_data_minutes() * self.data_rate)

    def summary(self) -> dict:
        """What the demo's summary records of the split: the rule's inputs and its outcome."""
        return {"rule": "(R - d) * train_rate = P * (N + d * data_rate)", "passes": self.passes,
                "data_examples_per_min": round(self.data_rate, 2), "train_samples_per_min": round(self.train_rate, 2),
                "examples_at_decision": self.examples, "minutes_left_at_decision": round(self.remaining, 2),
                "more_data_minutes": round(self.more_data_minutes(), 2), "expected_examples": self.expected_examples(),
                "line": self.line()}

    def line(self) -> str:
        return (f"split: data {self.data_rate:.0f} examples/min, training {self.train_rate:.0f} samples/min "
                f"(measured); {self.remaining:.1f} min left for both: {self.more_data_minutes():.1f} more min of data "
                f"(~{self.expected_examples()} examples), the rest training, for {self.passes:g} passes over the data")


def data_rate(manifest: dict) -> float:
    """Examples per minute of generation over the shards so far (model loading excluded)."""
    seconds = sum(s["seconds"] for s in manifest["shards"])
    return manifest["counts"]["examples"] / (seconds / 60) if seconds > 0 else float("inf")
