"""The 2-D prediction (issue 59): Llama3-70B trained at FSDP 32 x TP 8 on 256 H100s (32 nodes
of 8; tensor parallelism inside a node over NVLink, FSDP across nodes over InfiniBand 400G),
for the plugin's defaults and for FSDP2 + torch.compile, with and without async TP, beside
torchtitan's published tokens/s per GPU. A PREDICTION from the cost model
(``fsdp_overlap_plugin.report.costmodel``), not a measurement: nothing here ran on 256 GPUs.

    python benchmarks/predict_2d.py                    # the table (seconds, CPU, nothing downloaded)
    python benchmarks/predict_2d.py --json out.json
    python benchmarks/predict_2d.py --layers 2 --batch 1 --seq 1024   # a quick look at the shapes

How: the model is built on the meta device (``_harness/models.py``, Llama 3.1 70B: 80 layers,
hidden 8192, MLP 28672, 64 heads / 8 kv heads, vocabulary 128256); the plan is the auto plan
(one bucket per decoder layer, the embedding, the norm + head); ``cli/predict.bucket_costs``
gives each bucket's bytes (bf16 gathers, fp32 reduce-scatters) and FLOPs with full activation
checkpointing on every decoder layer (torchtitan's setting: the forward again in backward).
``costmodel.predict_step(..., tensor=8)`` then gives each rank 1/8 of every split bucket's
bytes and FLOPs (each FSDP group of 32 ranks holds 1/8 of each weight) and plays the
tensor-parallel collectives on their own lane at NVLink's rate, blocking the compute that
needs them (async TP: beside it); FSDP's collectives run among 32 ranks, one per node, at the
InfiniBand rate.

The tensor-parallel collectives, per decoder layer, of the activation (local batch x sequence
x hidden, bf16): without sequence parallelism (what the plugin runs: ``sequence_parallel`` is
an error in it today) 2 all-reduces forward and 2 backward; with it (torchtitan's plan, and
what async TP needs) an all-gather + reduce-scatter in place of each all-reduce. A ring moves
the same bytes either way ((n-1)/n of the tensor twice), so the two cost the same here but
for one latency; what sequence parallelism changes is memory (the checkpointed layer inputs
are split 8 ways). Full activation checkpointing recomputes the forward's 2 in backward too.
The embedding (rowwise) and the head (colwise, loss parallel) add one each way in torchtitan's
plan; the plugin's ``tp_plan: auto`` leaves both whole on every rank (no collective, 8x the
head's FLOPs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# torchtitan's published numbers, as found (issue 59; read in the pytorch/torchtitan repository):
# Float8: benchmarks/llama3_h100_202412_torchtitan.md (docs/performance.md until 2025-06),
#   "Table 4 2D parallelism (FSDP + TP) + torch.compile + Float8. Llama 3.1 70B model. 256 GPUs
#   (FSDP 32, TP 8). Local batch size 16, global batch size 512. Full activation checkpointing."
#   torch 1963fc8 (2024-12-23), torchtitan 9dec370 (2024-12-26).
# bf16: benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, "Llama3 70b on 256 H100s with
#   FSDP=32, TP=8, torch.compile, full AC, local batch size 16", None (bfloat16) row.
# Both on Grand Teton: H100 with 96 GB HBM2e at 2.4 TB/s, 500 W power limit, NVLink inside a
# host, 400 Gb/s RDMA per GPU. Neither table states the sequence length: 8192 is the seq_len of
# torchtitan's llama3_70b.toml at both commits (9dec370, 820504e). TPS per GPU there is tokens
# per step over the step's seconds over the non-data-parallel degree (train.py: TP 8), so each
# group of 8 ranks trains 16 x 8192 tokens a step.
SOURCE_FP8 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 4 (Float8, 2024-12)"
SOURCE_BF16 = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (bfloat16, 2025-06)"
PUBLISHED = {
    "bf16": {"vanilla TP": (597.3, SOURCE_BF16), "async TP": (652.4, SOURCE_BF16)},
    "float8": {"vanilla TP": (829, SOURCE_FP8 + ", 71.9 GiB"), "async TP": (876, SOURCE_FP8 + ", 67.6 GiB")},
}
# the link between nodes (FSDP) and the one inside a node (TP) come from this preset
PRESET = "h100-ib400"
# fp32 parameter, fp32 gradient, Adam's two fp32 moments: what each rank keeps of its shard
STATE_BYTES = 16
# label, schedule, sequence parallel, async TP, embedding and head split over the tensor group
VARIANTS = (
    ("plugin defaults, tp_plan auto (ends whole)", "passes", False, False, False),
    ("plugin defaults, every layer split", "passes", False, False, True),
    ("FSDP2 + compile, torchtitan plan (SP)", "fsdp2", True, False, True),
    ("FSDP2 + compile + async TP (SP)", "fsdp2", True, True, True),
    ("plugin + SP + async TP (not available)", "passes", True, True, True),
)
CALIBRATED_ON = "FSDP2 + compile, torchtitan plan (SP)"
ASYNC_ROW = "FSDP2 + compile + async TP (SP)"


def build(layers: int, seq: int):
    """Llama 3.1 70B with ``layers`` layers on the meta device (``_harness/models.py``)."""
    from _harness.models import build_llama, llama3_70b_config

    return build_llama(llama3_70b_config(layers, seq), device="meta")


def tp_collectives(name: str, activation: float, *, sequence_parallel: bool, recompute: bool) -> tuple[list, list]:
    """The tensor-parallel collectives of one bucket, forward and backward, each ``(op,
    bytes)`` of the whole activation: a decoder layer has 2 regions (attention, MLP), each
    ending in an all-reduce forward and another backward, or with sequence parallelism an
    all-gather in and a reduce-scatter out each way; a full recompute repeats the forward's in
    backward. The embedding (rowwise) reduces its output forward; the head (colwise, loss
    parallel) reduces its input's gradient backward; with sequence parallelism each does an
    all-gather or reduce-scatter both ways. Other buckets: none."""
    ar = [("all_reduce", activation)]
    sp = [("all_gather", activation), ("reduce_scatter", activation)]
    if name.startswith("model.layers."):
        forward = (sp if sequence_parallel else ar) * 2
        return forward, forward * (2 if recompute else 1)
    if name == "model.embed_tokens":
        return (sp[1:], sp[:1]) if sequence_parallel else (ar, [])
    if "lm_head" in name:
        return (sp[:1], sp[1:]) if sequence_parallel else ([], ar)
    return [], []


def predict(args: argparse.Namespace) -> dict:
    from fsdp_overlap_plugin.cli.predict import bucket_costs
    from fsdp_overlap_plugin.config.plan import resolve_plan
    from fsdp_overlap_plugin.config.schema import OverlapConfig
    from fsdp_overlap_plugin.report import costmodel

    model = build(args.layers, args.seq)
    hidden = model.config.hidden_size
    params = sum(p.numel() for p in model.parameters())
    checkpointed = ["model.layers.*"] if args.ac == "full" else []
    config = OverlapConfig(param_dtype="bf16", reduce_dtype="fp32", activation_checkpointing=checkpointed)
    plan = resolve_plan(model, config)
    buckets = bucket_costs(model, config, plan, batch=args.batch, seq=args.seq)
    cost = costmodel.resolve_rates("cuda", args.hardware or PRESET, args.profile)
    # FSDP's groups hold one rank per node: their collectives cross nodes; TP stays inside one
    rates = dict(cost["rates"], link=cost["rates"]["inter_link"], tensor_link=cost["rates"]["link"])
    activation = args.batch * args.seq * hidden * 2  # bf16, the whole activation a collective handles
    tokens_per_gpu = args.batch * args.seq / args.tensor  # a TP group shares its batch
    model_flops = sum(_model_flops(b) for b in buckets)
    rows = []
    for label, schedule, seq_parallel, overlap, ends_split in VARIANTS:
        split = []
        for b in buckets:
            layer = b["name"].startswith("model.layers.")
            whole = not (layer or ends_split)
            fwd, bwd = ([], []) if whole else tp_collectives(b["name"], activation, **_tp(seq_parallel, b))
            split.append(dict(b, tensor_split=not whole, tp_forward=fwd, tp_backward=bwd))
        held = sum(b["params"] / args.shard / (args.tensor if b["tensor_split"] else 1) for b in split)
        optimizer_s = 28 * held / costmodel.HARDWARE[cost["preset"]].mem  # AdamW: bytes read + written
        pred = costmodel.predict_step(
            split,
            rates,
            schedule=schedule,
            depth=1,
            shard=args.shard,
            tensor=args.tensor,
            tp_overlap=overlap,
            extra_compute_s=optimizer_s,
        )
        flops_per_gpu = sum(_model_flops(b) / (args.tensor if b["tensor_split"] else 1) for b in split)
        # a floor: the states of this rank's shard and the checkpointed layer inputs (split by
        # sequence under SP); leaves out one layer's recompute, the logits, the gathered buckets
        saved = args.layers * activation / (args.tensor if seq_parallel else 1) if args.ac == "full" else 0.0
        rows.append(
            {
                "variant": label,
                "schedule": schedule,
                "sequence_parallel": seq_parallel,
                "async_tp": overlap,
                "ends_split": ends_split,
                "step_s": pred["step_s"],
                "tps_per_gpu": tokens_per_gpu / pred["step_s"],
                "compute_s": pred["compute_s"] + optimizer_s,
                "optimizer_s": optimizer_s,
                "comm_s": pred["comm_s"],
                "tp_comm_s": pred["tensor_comm_s"],
                "exposed_comm_s": pred["exposed_comm_s"],
                "mfu_at_989": flops_per_gpu / pred["step_s"] / 989e12,
                "memory_floor_gib": (held * STATE_BYTES + saved) / 2**30,
            }
        )
    return {
        "model": {
            "layers": args.layers,
            "params": params,
            "batch": args.batch,
            "seq": args.seq,
            "buckets": len(plan),
            "shard": args.shard,
            "tensor": args.tensor,
            "ac": args.ac,
            "activation_bytes": activation,
        },
        "model_flops_per_step": model_flops,
        "rates": {**cost, "used": rates},
        "rows": rows,
        "published": PUBLISHED,
    }


def _model_flops(bucket: dict) -> float:
    """A bucket's FLOPs as MFU counts them: forward and backward, not the recompute."""
    return bucket["flops_forward"] + bucket["flops_backward"] - bucket["recompute_flops"]


def _tp(seq_parallel: bool, bucket: dict) -> dict:
    return {"sequence_parallel": seq_parallel, "recompute": bucket["recompute_flops"] > 0}


def at_published_compute(args: argparse.Namespace, result: dict, target: float) -> dict:
    """The same predictions with the compute rate at which the FSDP2 + torch.compile row
    (torchtitan's plan, vanilla TP) comes out at ``target`` tokens/s per GPU: what the
    schedules and async TP change at the compute speed torchtitan's GPUs reached (500 W,
    HBM2e; Float8 on the matmuls in one of the two tables)."""
    m = result["model"]
    step = m["batch"] * m["seq"] / m["tensor"] / target
    again, flops = result, result["rates"]["used"]["flops"]
    for _ in range(8):  # the exposed communication moves with the compute rate: settle both
        row = next(r for r in again["rows"] if r["variant"] == CALIBRATED_ON)
        work = (row["compute_s"] - row["optimizer_s"]) * flops  # this rank's FLOPs, recompute included
        flops = work / (step - row["optimizer_s"] - row["exposed_comm_s"])
        again = predict(argparse.Namespace(**{**vars(args), "profile": {"achieved_flops_per_s": flops}}))
    again["calibrated_flops"] = flops
    return again


def print_table(result: dict) -> None:
    m = result["model"]
    print(
        f"PREDICTED (cost model, not measured): Llama3-70B shapes, {m['layers']} layers, {m['params'] / 1e9:.1f}B "
        f"parameters, {m['buckets']} buckets, FSDP {m['shard']} x TP {m['tensor']} = {m['shard'] * m['tensor']} GPUs, "
        f"local batch {m['batch']} x {m['seq']} tokens per TP group, activation checkpointing: {m['ac']}"
    )
    sources = result["rates"]["sources"]
    print(f"compute: {sources['flops']}")
    print(f"TP (inside a node): {sources['link']}")
    print(f"FSDP (across nodes, 32 ranks): {sources['inter_link']}")
    _rows(result["rows"])
    print("published, measured by others (256 H100s at 500 W, HBM2e; full activation checkpointing):")
    for precision, entries in result["published"].items():
        for name, (tps, source) in entries.items():
            print(f"  {precision:<7} {name:<11} {tps:>6} TPS/GPU  ({source})")


def _rows(rows: list[dict]) -> None:
    print(
        f"{'variant':<44} {'step s':>7} {'TPS/GPU':>8} {'comm s':>7} {'TP s':>6} {'exposed s':>9} {'MFU':>5} "
        f"{'mem floor':>9}"
    )
    for r in rows:
        print(
            f"{r['variant']:<44} {r['step_s']:7.2f} {r['tps_per_gpu']:8.0f} {r['comm_s']:7.2f} {r['tp_comm_s']:6.2f} "
            f"{r['exposed_comm_s']:9.2f} {r['mfu_at_989'] * 100:4.0f}% {r['memory_floor_gib']:6.0f} GiB"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--batch", type=int, default=16, help="sequences per TP group (torchtitan's local batch: 16)")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--shard", type=int, default=32, help="FSDP degree: ranks per shard group, one per node")
    p.add_argument("--tensor", type=int, default=8, help="TP degree: ranks per node")
    p.add_argument("--ac", choices=("full", "none"), default="full", help="activation checkpointing of every layer")
    p.add_argument("--hardware", default=None, help=f"a hardware preset or own numbers (default {PRESET})")
    p.add_argument("--profile", default=None, help="a measured compute profile (gpu_check's compute_profile.json)")
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    result = predict(args)
    print_table(result)
    result["at_published_compute"] = {}
    for precision, entries in PUBLISHED.items():
        target, published_async = entries["vanilla TP"][0], entries["async TP"][0]
        fitted = at_published_compute(args, result, target)
        result["at_published_compute"][precision] = fitted
        row = next(r for r in fitted["rows"] if r["variant"] == ASYNC_ROW)
        print()
        print(
            f"the same, PREDICTED with compute at {fitted['calibrated_flops']:.3g} FLOP/s, the rate at which "
            f"'{CALIBRATED_ON}' matches torchtitan's {precision} {target} TPS/GPU:"
        )
        _rows(fitted["rows"])
        print(
            f"  async TP: predicted {row['tps_per_gpu']:.0f} TPS/GPU ({row['tps_per_gpu'] / target:.3f}x), "
            f"published {published_async} ({published_async / target:.3f}x)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
