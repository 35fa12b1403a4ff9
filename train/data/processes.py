"""This process's place in an `accelerate launch` of the data stage (or a single plain process)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import PartialState

from specdec.train.data.config import DataConfig


@dataclass
class Processes:
    """Process `index` of `count`; `device` is its own (None: the configured one)."""

    index: int = 0
    count: int = 1
    is_main: bool = True
    device: Any = None

    def barrier(self) -> None:
        if self.count > 1:
            PartialState().wait_for_everyone()


def processes(cfg: DataConfig) -> Processes:
    """This process's place in an `accelerate launch` (or a single plain process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Processes()
    # On CPU, accelerate only joins the process group when told cpu=True.
    state = PartialState(cpu=cfg.device == "cpu" or not torch.cuda.is_available())
    # device=cuda (no index) means each process's own GPU, as auto does
    device = state.device if cfg.device in ("auto", "", None) or cfg.device == state.device.type else None
    return Processes(state.process_index, state.num_processes, state.is_main_process, device)
