"""gpu_check.py's model arithmetic: the GPT's and the transformers Llamas' shapes,
parameter counts, training FLOPs per token, a memory estimate, tokens/s and MFU; and
torch's own FSDP2 + compile of a Llama, the baseline the plugin runs against."""

from __future__ import annotations

from typing import Any

from _harness import models

# The transformers Llamas of hf-1rank and world8 (LlamaConfig fields in plain names), and
# the tiny ones `--_size tiny` puts in their place so that a CPU test runs each phase.
# hf-1rank: 0.51B parameters (grouped-query attention, 8 of 16 heads); world8: Llama3-8B's
# layer shapes and vocabulary with 4 of its 32 layers, 1.92B parameters.
LLAMA_SHAPES = {
    "hf-1rank": {
        "default": dict(n_layer=8, hidden=2048, intermediate=5632, heads=16, kv_heads=8, vocab=32000),
        "tiny": dict(n_layer=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256),
    },
    "world8": {
        "default": dict(n_layer=4, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256),
        "tiny": dict(n_layer=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256),
    },
}


LLAMA_RUNS = {  # rope theta, batch x sequence per rank, ranks
    "hf-1rank": {"default": dict(rope_theta=10000.0, batch=4, seq=2048, world=1)},
    "world8": {"default": dict(rope_theta=500000.0, batch=2, seq=4096, world=8)},
}


TINY_RUN = dict(batch=2, seq=32)


LLAMA_VARIANTS = {
    "plugin": "plugin, parallelize() defaults",
    "fully_shard": "torch fully_shard per layer + torch.compile",
}


def matmul_params(cfg: dict[str, int]) -> int:
    """Parameters that take part in matmuls (every Linear weight: blocks and head); the
    embeddings are lookups and the biases and norms are element-wise."""
    d, v, n = cfg["d_model"], cfg["vocab_size"], cfg["n_layer"]
    return n * 12 * d * d + d * v


def flops_per_token(cfg: dict[str, int], seq: int) -> float:
    """Training FLOPs per token: 6 per matmul parameter (forward 2, backward 4), plus
    attention's scores and weighted sum, 12 * n_layer * seq * d_model (PaLM, appendix B:
    the full seq x seq matrix is counted, as the causal half is not skipped by every kernel)."""
    return 6 * matmul_params(cfg) + 12 * cfg["n_layer"] * seq * cfg["d_model"]


def throughput(
    tokens_per_step: int, step_s: float, fpt: float, matmul_flops_per_s: float | None
) -> dict[str, float | None]:
    """tokens/s, achieved model TFLOP/s and MFU (a fraction of the measured matmul rate)."""
    tokens_per_s = tokens_per_step / step_s
    achieved = tokens_per_s * fpt
    return {
        "tokens_per_s": tokens_per_s,
        "model_tflops": achieved / 1e12,
        "mfu": achieved / matmul_flops_per_s if matmul_flops_per_s else None,
    }


def param_count(cfg: dict[str, int]) -> int:
    """All parameters of the GPT (independent of building it)."""
    d, v, t, n = cfg["d_model"], cfg["vocab_size"], cfg["block_size"], cfg["n_layer"]
    block = 12 * d * d + 13 * d  # qkv 3d^2+3d, proj d^2+d, fc 4d^2+4d, proj 4d^2+d, 2 LayerNorms 4d
    return v * d + t * d + n * block + 2 * d + d * v


def memory_estimate(cfg: dict[str, int], batch: int, seq: int) -> dict[str, int]:
    """A rough peak for one rank holding the whole model (bytes): fp32 master weights,
    fp32 gradients, AdamW's two fp32 states, a bf16 copy of the weights, activations at
    ~34 bytes per token per layer per model dimension (Korthikanti et al., flash attention),
    and the logits (bf16, their fp32 copy for the loss, and its gradient)."""
    n = param_count(cfg)
    tokens = batch * seq
    parts = {
        "weights+grads+adam (fp32)": 16 * n,
        "bf16 weights": 2 * n,
        "activations": 34 * tokens * cfg["d_model"] * cfg["n_layer"],
        "logits": 10 * tokens * cfg["vocab_size"],
    }
    parts["total"] = sum(parts.values())
    return parts


def llama_shape(phase: str, size: str = "default") -> dict[str, Any]:
    """The model and run of a Llama phase: ``LLAMA_SHAPES`` fields plus rope theta, batch,
    sequence and world (``size`` "tiny": the tiny model, batch 2 x 32, same world)."""
    run = dict(LLAMA_RUNS[phase]["default"])
    if size == "tiny":
        run.update(TINY_RUN)
    return {**LLAMA_SHAPES[phase][size], **run}


def llama_matmul_params(shape: dict[str, Any]) -> int:
    """Parameters of a LlamaForCausalLM that take part in matmuls: per layer the q and o
    projections (hidden x hidden), k and v (hidden x kv_heads * head_dim), the MLP's gate,
    up and down (3 x hidden x intermediate); and the untied lm_head (hidden x vocab). The
    embedding is a lookup, the RMSNorm weights are element-wise."""
    h, n = shape["hidden"], shape["n_layer"]
    kv = shape["kv_heads"] * (h // shape["heads"])
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * shape["intermediate"]
    return n * per_layer + h * shape["vocab"]


def llama_param_count(shape: dict[str, Any]) -> int:
    """All parameters: the matmul ones, the embedding, two RMSNorms per layer and the final one."""
    h = shape["hidden"]
    return llama_matmul_params(shape) + shape["vocab"] * h + (2 * shape["n_layer"] + 1) * h


def llama_flops_per_token(shape: dict[str, Any], seq: int) -> float:
    """Training FLOPs per token of a Llama, counted as for the GPT (``flops_per_token``): 6 per
    matmul parameter (forward 2, backward 4) plus attention's scores and weighted sum,
    12 * layers * seq * hidden (hidden = query heads x head dim; grouped-query attention
    shares k and v between heads but every query head still multiplies, so the kv heads do
    not change it; the full seq x seq matrix is counted, as for the GPT)."""
    return 6 * llama_matmul_params(shape) + 12 * shape["n_layer"] * seq * shape["hidden"]


def llama_config(shape: dict[str, Any]) -> Any:
    """The ``transformers.LlamaConfig`` of ``shape``, built with the fields transformers 5.17
    (the GPU machines') already has: rope theta through ``rope_parameters``, sdpa attention,
    no KV cache (training), untied lm_head, positions up to the sequence length (built by
    ``models.llama_config``, where every benchmark's model config is built)."""
    return models.llama_config(
        shape["hidden"],
        shape["n_layer"],
        shape["heads"],
        shape["kv_heads"],
        shape["intermediate"],
        shape["vocab"],
        shape["seq"],
        rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]},
        use_cache=False,
        attn_implementation="sdpa",
    )


def fully_shard_and_compile(model: Any, mesh: Any, backend: str) -> Any:
    """torch's own FSDP2 as users combine it with compile: ``fully_shard`` on every decoder
    layer and on the root, bf16 parameters and fp32 gradient reduction, then
    ``torch.compile`` of the whole model (FSDP2's hooks run outside the graphs: Dynamo
    breaks the graph around each layer)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp_overlap_plugin.shard.hf import prepare_for_compile

    prepare_for_compile(model)  # as parallelize does: no logger call inside the loss
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return torch.compile(model, backend=backend)
