"""Models: GPT-2 with logical sharding names and its sharding plan."""

from theseus.model.gpt import GPT, GPT_PLAN, GPTConfig

__all__ = ["GPT", "GPT_PLAN", "GPTConfig"]
