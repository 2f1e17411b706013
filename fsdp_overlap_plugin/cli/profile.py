"""``profile``: measure this machine's compute rate on the user's model, for the cost model.

The model is built as ``check`` builds it (a factory or an ``hf:`` config), allocated and
initialised on one device, unsharded, compiled as ``parallelize`` compiles it (inductor,
full graph; ``--no-compile`` times it eager), and trained for a few steps on random tokens
(forward, backward, SGD). Its FLOPs per step are counted as the predictions count them
(``predict.bucket_costs``: 2 per matmul parameter per token forward, twice that backward,
plus attention), so ``achieved_flops_per_s = FLOPs / median step`` is the rate a
prediction for this model on this machine should use. The JSON it writes is what
``compute_profile:`` and ``--profile`` read (benchmarks/gpu_check.py's world8 phase writes
the same keys on a GPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import CliError
from .models import load_model, sequence_length
from .options import PROFILE_SEQ

__all__ = ["PROFILE_SEQ", "cmd_profile", "measure_compute"]


def _vocab(model: nn.Module) -> int:
    """Token ids must index the model's first embedding table."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.num_embeddings
    raise CliError("profile: the model has no nn.Embedding; it needs a token model (a causal LM)")


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """A transformers causal LM's own loss (labels = inputs), else next-token cross-entropy
    of the logits the model returns."""
    from ..shard.hf import is_transformers_model

    if is_transformers_model(model):
        return model(input_ids=tokens, labels=tokens).loss
    out = model(tokens)
    logits = out[0] if isinstance(out, (tuple, list)) else out
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))


def measure_compute(
    model: nn.Module,
    *,
    flops_per_step: float,
    batch: int,
    seq: int,
    steps: int = 5,
    warmup: int = 2,
    device: str = "cpu",
    compile: bool = True,
) -> dict[str, Any]:
    """Time ``steps`` training steps of an allocated, unsharded model (after ``warmup``);
    return the profile's keys."""
    from ..shard.hf import prepare_for_compile

    vocab = _vocab(model)
    model.train()
    if compile:
        prepare_for_compile(model)
        model.compile(backend="inductor", fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elif device.startswith("npu"):  # pragma: no cover - needs torch_npu
            torch.npu.synchronize()

    times = []
    first = None
    for i in range(warmup + steps):
        sync()
        t = time.perf_counter()
        _loss(model, tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        elapsed = time.perf_counter() - t
        if i == 0:
            first = elapsed
        if i >= warmup:
            times.append(elapsed)
    step = statistics.median(times)
    return {
        "step_s": step,
        "first_step_s": first,
        "steps": times,
        "schedule_flops_per_step": flops_per_step,
        "achieved_flops_per_s": flops_per_step / step,
    }


def cmd_profile(args: argparse.Namespace) -> tuple[int, dict[str, Any], list[str]]:
    from ..config.plan import resolve_plan
    from ..config.schema import OverlapConfig
    from ..shard.initialize import materialize
    from .predict import bucket_costs

    for name in ("batch", "seq", "steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise CliError(f"profile: --{name} must be at least 1, got {getattr(args, name)}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CliError("profile: --device cuda, but torch sees no CUDA GPU here")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, info = load_model(args.model, args.model_arg)
    # a longer sequence than the model's positions indexes past its table: checked here, in words,
    # not by a native kernel's abort
    seq, seq_note = sequence_length(args.seq, model, args.model, PROFILE_SEQ)
    config = OverlapConfig()
    costs = bucket_costs(model, config, resolve_plan(model, config), batch=args.batch, seq=seq)
    flops = sum(b["flops_forward"] + b["flops_backward"] for b in costs)
    torch.manual_seed(0)
    materialize(model, device, on_uninitialized="warn")
    if args.dtype == "bf16":
        model.to(torch.bfloat16)
    result = measure_compute(
        model,
        flops_per_step=flops,
        batch=args.batch,
        seq=seq,
        steps=args.steps,
        warmup=args.warmup,
        device=device,
        compile=not args.no_compile,
    )
    name = (
        torch.cuda.get_device_name()
        if device.startswith("cuda")
        else f"{platform.processor() or platform.machine()} CPU"
    )
    profile = {
        "device": f"{name}, {torch.get_num_threads()} threads" if device == "cpu" else name,
        "device_type": device.split(":")[0],
        "torch": torch.__version__,
        "model": {"spec": args.model, "params": info.get("params"), "batch": args.batch, "seq": seq},
        "compiled": not args.no_compile,
        "dtype": args.dtype,
        **result,
    }
    Path(args.out).write_text(json.dumps(profile, indent=1))
    lines = [seq_note] if seq_note else []
    lines += [
        f"profile: {args.model} on {profile['device']}, {'compiled' if profile['compiled'] else 'eager'}, "
        f"{args.batch} x {seq} tokens, {args.dtype}",
        f"  median step {result['step_s'] * 1e3:.1f} ms over {args.steps} steps (first {result['first_step_s']:.1f} s); "
        f"{flops:.3g} FLOPs per step -> {result['achieved_flops_per_s']:.3g} FLOP/s achieved",
        f"  written to {args.out}: use it with compute_profile: {args.out} in the plugin config, or --profile "
        f"{args.out} with check, inspect and suggest",
    ]
    return 0, {"command": "profile", "out": args.out, "profile": profile, "seq_note": seq_note}, lines
