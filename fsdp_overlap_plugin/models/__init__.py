"""Reference models for examples, tests and benchmarks."""

from .gpt import GPT, GPTConfig, fixed_batches, gpt_1b, gpt_bench, gpt_small, loss_fn

__all__ = ["GPT", "GPTConfig", "fixed_batches", "gpt_1b", "gpt_bench", "gpt_small", "loss_fn"]
