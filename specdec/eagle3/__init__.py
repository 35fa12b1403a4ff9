"""EAGLE-3 drafts (Li et al. 2025, arXiv:2503.01840), computed as the serving engines compute them.

    model.py     the draft's computation: config from the target's, the layer, the cached and unrolled forwards
    attention.py the unrolled training-time test's attention, chunked (memory linear in the sequence length)
    formats.py   its checkpoint layouts (the engines', speculators'), written and read
    states.py    the target's hidden states it reads: the recorder (forward hooks) and the one forward for them
    drafter.py   decoding with it (specdec/drafter.py's interface)
    replay.py    its held-out replay, unrolled as the decoder proposes
    kind.py      the kinds registered in specdec/draft_registry.py: EAGLE-3, and P-EAGLE (a round in one forward)
"""

from specdec.eagle3.drafter import Eagle3Drafter
from specdec.eagle3.formats import ARCHITECTURE, FORMATS, is_eagle3_config
from specdec.eagle3.kind import NAME, PARALLEL_NAME, Eagle3Kind, PEagleKind
from specdec.eagle3.model import (
    Eagle3Draft,
    check_layer_ids,
    default_layer_ids,
    draft_config,
    positions_in_documents,
)
from specdec.eagle3.replay import unrolled_ranks
from specdec.eagle3.states import RECORDED_STATES_DTYPE, HiddenStateRecorder, target_states

__all__ = ["ARCHITECTURE", "FORMATS", "NAME", "RECORDED_STATES_DTYPE", "Eagle3Draft", "Eagle3Drafter", "Eagle3Kind",
           "PARALLEL_NAME", "PEagleKind",
           "HiddenStateRecorder", "check_layer_ids", "default_layer_ids", "draft_config", "is_eagle3_config",
           "positions_in_documents", "target_states", "unrolled_ranks"]
