"""DFlash drafts (Chen et al. 2026, arXiv:2602.06036): a block of tokens proposed in one draft forward.

    model.py     the draft's computation: config from the target's, the layers, the context cache, anchored blocks
    formats.py   its checkpoint layouts (vLLM's, speculators'), written and read
    drafter.py   decoding with it (specdec/drafter.py's interface)
    replay.py    its held-out replay, a block at each scored position
    kind.py      the kind registered in specdec/draft_registry.py
"""

from specdec.dflash.drafter import DFlashDrafter
from specdec.dflash.formats import ARCHITECTURE, FORMATS, is_dflash_config
from specdec.dflash.kind import NAME, DFlashKind
from specdec.dflash.model import DFlashDraft, anchored_mask, default_layer_ids, draft_config

__all__ = ["ARCHITECTURE", "FORMATS", "NAME", "DFlashDraft", "DFlashDrafter", "DFlashKind", "anchored_mask",
           "default_layer_ids", "draft_config", "is_dflash_config"]
