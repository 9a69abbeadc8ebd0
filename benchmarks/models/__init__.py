"""The small GPT shared by the demo, the examples and the benchmarks."""
from .gpt import GPT, PRESETS, GPTConfig, build_model, get_config

__all__ = ["GPT", "GPTConfig", "PRESETS", "build_model", "get_config"]
