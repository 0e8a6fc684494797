"""tandem: LLM serving with prefill and decode disaggregated into two pools."""

from tandem.llm import LLM
from tandem.outputs import RequestDelta, RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.sequence import FinishReason

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestDelta", "FinishReason"]
