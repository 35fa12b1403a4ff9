"""The data stage's recorder of the target's hidden states, under its earlier name (see specdec/eagle3.py)."""

from __future__ import annotations

from specdec.eagle3 import HiddenStateRecorder


class FeatureRecorder(HiddenStateRecorder):
    """The target's final hidden state, then the outputs of decoder layers `aux_layers` (0-based), per forward."""

    def __init__(self, target, aux_layers=(), history: bool = False):
        super().__init__(target, [int(i) + 1 for i in aux_layers], final=True, history=history)
