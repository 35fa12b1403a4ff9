"""The target's hidden states an EAGLE-3 draft reads: recorded by forward hooks during the target's own forwards
(`HiddenStateRecorder`), or computed by one forward of the target's decoder (`target_states`, the one function
that runs the target for its states: the decoder's replay, training's online states and the data stage's
prefill all call it)."""

from __future__ import annotations

import torch
from torch import nn

from specdec.eagle3.model import check_layer_ids

# How recorded target states are stored: bf16 keeps float32's range, which the residual streams of large targets
# need (their outlier dimensions reach magnitudes where float16 loses precision or overflows); the peers store
# bf16 too. Every reader casts to float32.
RECORDED_STATES_DTYPE = torch.bfloat16


class HiddenStateRecorder:
    """The target's residual stream after each of `layer_ids` decoder layers, from its latest forward, [B, n, 3H]
    (forward hooks on the decoder layers; no second forward). With `final=True` the final norm's output (what
    the head reads) comes first: the online teacher's input. `history=True` keeps every forward's states
    (RECORDED_STATES_DTYPE, on the CPU), in order: what `specdec data record_features=true` stores."""

    def __init__(self, target: nn.Module, layer_ids: list[int], final: bool = False, history: bool = False):
        layers = target.get_decoder().layers
        ids = check_layer_ids(layer_ids, len(layers)) if layer_ids or not final else []
        modules = ([target.get_decoder().norm] if final else []) + [layers[i - 1] for i in ids]
        self._parts: list[torch.Tensor | None] = [None] * len(modules)
        self._last = len(modules) - 1 if not final else 0  # the module that runs last in a forward
        self.history: list[torch.Tensor] | None = [] if history else None
        self._handles = [m.register_forward_hook(self._keeper(i)) for i, m in enumerate(modules)]

    def _keeper(self, index: int):
        def keep(_module, _inputs, output) -> None:
            self._parts[index] = output[0] if isinstance(output, tuple) else output
            if index == self._last and self.history is not None:
                self.history.append(self.latest.detach().to("cpu", RECORDED_STATES_DTYPE))
        return keep

    @property
    def latest(self) -> torch.Tensor | None:
        if any(p is None for p in self._parts):
            return None
        return self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts, dim=-1)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def __enter__(self) -> HiddenStateRecorder:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


@torch.no_grad()
def target_states(target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  layer_ids, final: bool = False) -> torch.Tensor:
    """One forward of the target's decoder (no head): its residual stream after each of `layer_ids` layers,
    concatenated, preceded by the final norm's output (the head's input) with `final=True`.
    [B, S, (final + len(layer_ids)) H], in the target's dtype, on its device."""
    with HiddenStateRecorder(target, list(layer_ids), final=final) as recorder:
        target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask)
        return recorder.latest
