"""Reference models for examples, tests and benchmarks: a small GPT, and the config of a
tiny transformers Llama with data it learns from."""

from .gpt import GPT, GPTConfig, fixed_batches, gpt_1b, gpt_bench, gpt_small, loss_fn
from .llama import TINY_LLAMA, counting_sequences

__all__ = [
    "GPT",
    "GPTConfig",
    "TINY_LLAMA",
    "counting_sequences",
    "fixed_batches",
    "gpt_1b",
    "gpt_bench",
    "gpt_small",
    "loss_fn",
]
