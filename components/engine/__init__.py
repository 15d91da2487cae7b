"""The HunyuanImage-3 engine shared by the AR and DiT steps."""

from .ar import AROutput, ARRequest, SamplingParams
from .config import HunyuanImage3Config, get_config
from .dit import DiTOutput, DiTRequest
from .engine import Engine
from .kvcache import PromptKV

__all__ = ["AROutput", "ARRequest", "DiTOutput", "DiTRequest", "Engine", "HunyuanImage3Config", "PromptKV",
           "SamplingParams", "get_config"]
