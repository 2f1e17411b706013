"""The benchmarks' model zoo: the repo GPT and a transformers Llama by size, their losses
and block plans, and the fixed batches every rank and mode trains on; and the one place the
scripts build a model or a model config (``build_gpt``, ``gpt_preset``, ``llama_config``,
``llama3_8b_config``, ``build_llama``: tests/bench/test_harness_layout.py holds that)."""

from __future__ import annotations

from typing import Any

MODEL_SIZES = {
    # name: (d_model, n_layer, n_head, vocab, seq); ~parameters in the comment
    "small": (256, 4, 8, 512, 128),  # 3.4M
    "medium": (256, 8, 8, 512, 128),  # 6.6M
    "large": (384, 8, 8, 1024, 128),  # 15M
}
MODELS = ("gpt", "hf-llama", "hf-qwen2")
HF_LLAMA_SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab, seq); ~parameters in the comment
    # small: the GPT small's compute (one thread: 1.00 x its compiled step, measured interleaved)
    "small": (256, 4, 8, 4, 768, 512, 128),  # 3.4M
    "medium": (256, 8, 8, 4, 768, 512, 128),  # 6.6M
    "large": (384, 8, 8, 4, 1024, 1024, 128),  # 13.8M
}
# hf-qwen2: a transformers Qwen2ForCausalLM of the same shapes as hf-llama, but with q/k/v
# biases and a tied head (the embedding is also the output projection); the cost model's
# third model, which its host terms were never fitted on (benchmarks/RESULTS.md)
HF_QWEN2_SIZES = HF_LLAMA_SIZES
BLOCKS = {"gpt": "blocks", "hf-llama": "model.layers", "hf-qwen2": "model.layers"}  # container of the repeated blocks
BATCH_PER_RANK = 8
LR = 0.05


def model_shape(model: str, size: str) -> tuple:
    """The size's tuple for ``model`` (``MODEL_SIZES`` or ``HF_LLAMA_SIZES``)."""
    return {"gpt": MODEL_SIZES, "hf-llama": HF_LLAMA_SIZES, "hf-qwen2": HF_QWEN2_SIZES}[model][size]


def vocab_and_seq(model: str, size: str) -> tuple[int, int]:
    shape = model_shape(model, size)
    return shape[-2], shape[-1]


def describe_model(model: str, size: str) -> str:
    if model == "gpt":
        d, layers, heads, vocab, seq = MODEL_SIZES[size]
        return f"model gpt {size} (d={d}, {layers} blocks, {heads} heads, vocab {vocab}, seq {seq}"
    hidden, layers, heads, kv, inter, vocab, seq = model_shape(model, size)
    cls, head = ("Qwen2ForCausalLM", "tied, q/k/v biases") if model == "hf-qwen2" else ("LlamaForCausalLM", "untied")
    return (
        f"model {model} {size} (transformers {cls}, sdpa attention, hidden {hidden}, {layers} layers, "
        f"{heads} heads / {kv} kv heads, MLP {inter}, vocab {vocab} {head}, seq {seq}"
    )


def build_model(model: str, size: str):
    """The model, seeded: identical on every rank and in every mode."""
    import torch

    torch.manual_seed(0)
    if model == "gpt":
        return build_gpt(*MODEL_SIZES[size])
    if model == "hf-qwen2":
        return build_hf_qwen2(*HF_QWEN2_SIZES[size])
    return build_hf_llama(*HF_LLAMA_SIZES[size])


def build_gpt(d_model: int, layers: int, heads: int, vocab: int, seq: int, *, seed: int | None = None):
    """The repo GPT of a ``MODEL_SIZES`` tuple (d_model, layers, heads, vocab, seq); with
    ``seed``, ``torch.manual_seed(seed)`` first."""
    return gpt_preset(
        "small", seed=seed, vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, d_model=d_model
    )


def gpt_preset(name: str = "small", *, seed: int | None = None, **overrides: int):
    """The package's own GPT presets (``fsdp_overlap_plugin.models.gpt_small`` /
    ``gpt_bench`` / ``gpt_1b``: "small", "bench", "1b"), ``GPTConfig`` fields overridden by
    ``overrides``; with ``seed``, ``torch.manual_seed(seed)`` first. Built on the current
    default device (``with torch.device("meta"):`` around the call). The scripts build
    their GPTs only here."""
    import torch

    from fsdp_overlap_plugin.models import gpt_1b, gpt_bench, gpt_small

    if seed is not None:
        torch.manual_seed(seed)
    return {"small": gpt_small, "bench": gpt_bench, "1b": gpt_1b}[name](**overrides)


def llama_config(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    seq: int | None = None,
    *,
    tied: bool = False,
    **fields: Any,
):
    """A transformers ``LlamaConfig`` in the zoo's plain names (the order of an
    ``HF_LLAMA_SIZES`` tuple); ``seq`` is ``max_position_embeddings`` (None: transformers'
    default), ``fields`` any other ``LlamaConfig`` field as transformers spells it. Only the
    fields given are set, so each script's Llama is the one it always built."""
    if seq is not None:
        fields["max_position_embeddings"] = seq
    return _hf_config("llama", hidden, layers, heads, kv_heads, intermediate, vocab, tied=tied, **fields)


def _hf_config(model_type: str, hidden, layers, heads, kv_heads, intermediate, vocab, *, tied: bool, **fields: Any):
    """The transformers config of ``model_type`` with the zoo's sizes in transformers'
    names, ``fields`` as given (``AutoConfig.for_model``: ``"llama"`` is a ``LlamaConfig``)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        **fields,
    )


# Llama 3.1 8B's layer shapes and vocabulary in transformers' names (predict_scale.py's model,
# with as many layers as it asks for)
LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


def llama3_8b_config(layers: int, seq: int):
    """Llama 3.1 8B's ``LlamaConfig`` with ``layers`` decoder layers, positions up to
    ``max(seq, 8192)``, sdpa attention."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=layers, max_position_embeddings=max(seq, 8192), **LLAMA3_8B)
    config._attn_implementation = "sdpa"
    return config


# Llama 3.1 70B's layer shapes and vocabulary in transformers' names (predict_2d.py's model)
LLAMA3_70B = {
    **LLAMA3_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}


def llama3_70b_config(layers: int, seq: int):
    """Llama 3.1 70B's ``LlamaConfig`` (80 layers in the model; ``layers`` of them here),
    positions up to ``max(seq, 8192)``, sdpa attention."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=layers, max_position_embeddings=max(seq, 8192), **LLAMA3_70B)
    config._attn_implementation = "sdpa"
    return config


def build_llama(config: Any, *, device: Any = None, seed: int | None = None, direct: bool = False):
    """The transformers Llama of ``config`` (``llama_config``), randomly initialised: as
    the plugin builds one from a config (``shard.hf.model_from_config``: the class the
    config's ``architectures`` names, else ``AutoModelForCausalLM.from_config``), or with
    ``direct`` by calling ``LlamaForCausalLM(config)`` (the scripts that always did keep
    doing so). ``device="meta"``: nothing allocated; ``seed``: ``torch.manual_seed`` first."""
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    if direct:
        import contextlib

        import transformers

        with torch.device(device) if device is not None else contextlib.nullcontext():
            return transformers.LlamaForCausalLM(config)
    from fsdp_overlap_plugin.shard.hf import model_from_config

    return model_from_config(config, device=device)


def build_hf_llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int, seq: int):
    """A transformers ``LlamaForCausalLM`` from a ``LlamaConfig`` (nothing downloaded):
    sdpa attention (one graph under our compile, as the tests' Llama uses), untied head,
    no KV cache, dropout off (Llama's default); in train mode."""
    return _build_hf("llama", False, hidden, layers, heads, kv_heads, intermediate, vocab, seq)


def build_hf_qwen2(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int, seq: int):
    """A transformers ``Qwen2ForCausalLM`` from a ``Qwen2Config`` (nothing downloaded), as
    ``build_hf_llama`` but with Qwen2's q/k/v biases and a tied head."""
    return _build_hf("qwen2", True, hidden, layers, heads, kv_heads, intermediate, vocab, seq)


def _build_hf(model_type: str, tied: bool, hidden, layers, heads, kv_heads, intermediate, vocab, seq):
    from transformers import AutoModelForCausalLM

    config = _hf_config(
        model_type,
        hidden,
        layers,
        heads,
        kv_heads,
        intermediate,
        vocab,
        tied=tied,
        max_position_embeddings=seq,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    return model


def loss_for(model_name: str, model):
    """``loss(x, y)`` for one batch: the GPT's cross-entropy against ``y``; the transformers
    model's own causal-LM loss (``labels=x``, shifted inside: the same targets as ``y``)."""
    if model_name == "gpt":
        from fsdp_overlap_plugin.models import loss_fn

        return lambda x, y: loss_fn(model(x), y)
    return lambda x, y: model(input_ids=x, labels=x).loss


def block_plan(model_name: str, model) -> list[list[str]]:
    """One bucket per repeated block (embeddings, final norm and head left to the root)."""
    container = BLOCKS[model_name]
    return [[f"{container}.{i}"] for i in range(len(model.get_submodule(container)))]


def parse_lengths(text: str) -> list[int]:
    """'64,96,128' -> [64, 96, 128]."""
    return [int(x) for x in text.split(",") if x.strip()]


def _data(vocab: int, seq: int, world: int, steps: int, lengths: list[int] | None = None):
    """The fixed batches (the same on every rank and in every mode); with ``lengths``,
    batch k cut to ``lengths[k % len(lengths)]`` tokens."""
    from fsdp_overlap_plugin.models import fixed_batches

    batches = fixed_batches(steps, BATCH_PER_RANK * world, seq, vocab, seed=7)
    if not lengths:
        return batches
    cut = [lengths[k % len(lengths)] for k in range(steps)]
    return [(x[:, :n].contiguous(), y[:, :n].contiguous()) for (x, y), n in zip(batches, cut)]
