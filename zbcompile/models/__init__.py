"""Small reference models used by the demo, the benchmarks and the tests."""

from zbcompile.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
