"""specdec: train draft models for a target model and decode speculatively, exactly."""

from specdec.decode import GenerateOutput, speculative_generate, target_generate
from specdec.sampling import SamplingConfig

__all__ = ["GenerateOutput", "SamplingConfig", "speculative_generate", "target_generate"]
__version__ = "0.1.0"
