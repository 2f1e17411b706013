"""A tiny Llama-style ``transformers`` config and learnable token data, for the examples that
train a Hugging Face model (``examples/hf_lightning.py``, ``examples/hf_accelerate.py``).
Plain data: nothing here imports ``transformers``."""

from __future__ import annotations

import torch

__all__ = ["TINY_LLAMA", "counting_sequences"]

#: config.json keys of the examples' default model (``AutoConfig.for_model(**TINY_LLAMA)``).
TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    # even, so both ranks' shards have the same shape: with uneven shards a second run on a
    # warm inductor cache crashed in torch 2.13 (docs/troubleshooting.md, "Fixed problems")
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,  # lm_head shares the embedding's weight
    "use_cache": False,
}


def counting_sequences(samples: int, seq_len: int, vocab_size: int, seed: int = 1234) -> torch.Tensor:
    """``[samples, seq_len]`` token ids that can be learnt in a few steps: each sequence
    counts up from a random start by a random stride (mod the vocabulary), so two tokens
    predict the next. The first sequences do not depend on ``samples``."""
    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, vocab_size, (samples, 2, 1), generator=g).unbind(1)  # row by row
    return (start + (stride % 7 + 1) * torch.arange(seq_len)) % vocab_size
