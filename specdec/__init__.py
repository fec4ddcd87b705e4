"""specdec: lossless speculative decoding for local LLM inference."""

from specdec.api import LLM, Result
from specdec.constraint import Grammar
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams

__all__ = ["LLM", "Grammar", "Result", "SamplingParams", "SpecdecError"]
__version__ = "0.1.0"
