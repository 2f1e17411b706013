"""The prediction users ask for: Llama3-8B at torchtitan's published setting on 8 H100s
(one NVLink node) and on 4 nodes of 8 H100s over InfiniBand 400G (HSDP: shard inside a
node, replicate across nodes), for the plugin's defaults, eager FSDP2 and FSDP2 +
torch.compile, beside torchtitan's published tokens/s per GPU. A PREDICTION from the cost
model (``fsdp_overlap_plugin.report.costmodel``), not a measurement: the method and its measured
error are in benchmarks/RESULTS.md ("The cost model, calibrated").

    python benchmarks/predict_scale.py                 # the table (a few seconds, CPU, nothing downloaded)
    python benchmarks/predict_scale.py --json out.json
    python benchmarks/predict_scale.py --layers 4 --batch 2 --seq 4096 --world 8   # gpu_check's world8 shape

How: the model is built on the meta device from a ``LlamaConfig`` (Llama 3.1 8B: 32 layers,
hidden 4096, MLP 14336, 32 heads / 8 kv heads, vocabulary 128256); the plan is the one
``parallelize`` resolves (the auto plan: one bucket per decoder layer); each bucket's bytes
(bf16 gathers, fp32 reduce-scatters) and FLOPs (2 per matmul parameter per token forward,
4 backward, attention 4 b s^2 h forward) come from ``cli/predict.bucket_costs``; the step is
``costmodel.plan_schedule`` played by ``costmodel.simulate`` with a hardware preset's link
rates and a compute rate measured on a GPU (the preset's, or ``--profile``). The three
schedules: "passes" (the defaults), "fsdp2" (``fully_shard``: per-layer gathers prefetched
one ahead on their own stream, reduce-scatters and replica all-reduces behind compute),
the same "fsdp2" schedule with eager compute (``EAGER_COMPUTE``, measured) for eager FSDP2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# torchtitan docs/performance.md, Table 1: Llama 3.1 8B, 8 H100s (Grand Teton: 96 GB HBM2e
# at 2.4 TB/s, 500 W power limit, 400 Gb/s RDMA per GPU), local batch 2, sequence 8192,
# selective activation checkpointing, bf16. SimpleFSDP's figure is as issue 42 quotes it
# (SimpleFSDP, arXiv 2411.00284, manual bucketing); not checked against the paper here.
PUBLISHED = {
    "eager FSDP2": (5762, "torchtitan docs/performance.md, Table 1 (FSDP)"),
    "FSDP2 + torch.compile": (6667, "torchtitan docs/performance.md, Table 1 (FSDP + torch.compile)"),
    "SimpleFSDP, manual bucketing": (7227, "SimpleFSDP (arXiv 2411.00284) as issue 42 quotes it"),
}
# How much longer eager compute takes than compiled, measured on one H200 (issue 42):
# gpt_1b eager fully_shard 0.291 s per step against 0.277 s compiled with the passes.
EAGER_COMPUTE = 0.291 / 0.277
SCENARIOS = (
    ("8x H100, one NVLink node", "h100-nvlink", 8, 1),
    ("4 nodes x 8 H100, InfiniBand 400G, HSDP (shard 8, replicate 4)", "h100-ib400", 32, 4),
)
VARIANTS = (
    ("the plugin's defaults", "passes", 1.0),
    ("eager FSDP2", "fsdp2", EAGER_COMPUTE),
    ("FSDP2 + torch.compile", "fsdp2", 1.0),
)


def build(layers: int, seq: int):
    """Llama 3.1 8B with ``layers`` layers on the meta device (``_harness/models.py``)."""
    from _harness.models import build_llama, llama3_8b_config

    return build_llama(llama3_8b_config(layers, seq), device="meta")


def predict(args: argparse.Namespace) -> dict:
    from fsdp_overlap_plugin.cli.predict import bucket_costs
    from fsdp_overlap_plugin.config.plan import resolve_plan
    from fsdp_overlap_plugin.config.schema import OverlapConfig
    from fsdp_overlap_plugin.report import costmodel

    model = build(args.layers, args.seq)
    params = sum(p.numel() for p in model.parameters())
    config = OverlapConfig(param_dtype="bf16", reduce_dtype="fp32")
    plan = resolve_plan(model, config)
    tokens = args.batch * args.seq
    rows = []
    scenarios = SCENARIOS if args.world is None else (("custom", args.hardware or "h100-nvlink", args.world, 1),)
    for label, preset, world, replicas in scenarios:
        shard = world // replicas
        cost = costmodel.resolve_rates("cuda", args.hardware or preset, args.profile)
        buckets = bucket_costs(model, config, plan, batch=args.batch, seq=args.seq)
        flops = sum(b["flops_forward"] + b["flops_backward"] for b in buckets)
        # AdamW on this rank's shard: bytes read + written, at the preset's memory rate
        optimizer_s = 28 * params / shard / costmodel.HARDWARE[cost["preset"]].mem
        for name, schedule, slow in VARIANTS:
            rates = dict(cost["rates"], flops=cost["rates"]["flops"] / slow)
            pred = costmodel.predict_step(
                buckets, rates, schedule=schedule, depth=1, shard=shard, replicas=replicas, extra_compute_s=optimizer_s
            )
            rows.append(
                {
                    "scenario": label,
                    "hardware": cost["preset"],
                    "world": world,
                    "replicas": replicas,
                    "variant": name,
                    "step_s": pred["step_s"],
                    "tps_per_gpu": tokens / pred["step_s"],
                    "compute_s": pred["compute_s"] + optimizer_s,
                    "optimizer_s": optimizer_s,
                    "comm_s": pred["comm_s"],
                    "exposed_comm_s": pred["exposed_comm_s"],
                    "mfu_at_989": flops / pred["step_s"] / 989e12,
                }
            )
    return {
        "model": {"layers": args.layers, "params": params, "batch": args.batch, "seq": args.seq, "buckets": len(plan)},
        "flops_per_step": flops,
        "rates": cost,
        "rows": rows,
        "published": PUBLISHED,
    }


def at_published_compute(args: argparse.Namespace, result: dict) -> dict:
    """The same predictions with the compute rate that makes FSDP2 + torch.compile on one
    NVLink node come out at torchtitan's published 6,667 TPS/GPU (their H100s run at 500 W
    with HBM2e, and selective activation checkpointing recomputes part of the forward): what
    the schedules alone change at that compute speed, and how far the eager prediction then
    lands from their eager number."""
    m = result["model"]
    target = m["batch"] * m["seq"] / PUBLISHED["FSDP2 + torch.compile"][0]  # seconds per step
    again = result
    for _ in range(6):  # the exposed communication moves with the compute rate: settle both
        row = next(r for r in again["rows"] if r["variant"] == "FSDP2 + torch.compile" and r["replicas"] == 1)
        flops = result["flops_per_step"] / (target - row["optimizer_s"] - row["exposed_comm_s"])
        profile = {"achieved_flops_per_s": flops}
        again = predict(argparse.Namespace(**{**vars(args), "hardware": None, "profile": profile}))
    again["calibrated_flops"] = flops
    return again


def print_table(result: dict) -> None:
    m = result["model"]
    print(
        f"PREDICTED (cost model, not measured): Llama3-8B shapes, {m['layers']} layers, {m['params'] / 1e9:.2f}B "
        f"parameters, {m['buckets']} buckets, {m['batch']} x {m['seq']} tokens per GPU, no activation checkpointing"
    )
    print(f"compute: {result['rates']['sources']['flops']}")
    print(f"links: {result['rates']['sources']['link']}; between nodes: {result['rates']['sources']['inter_link']}")
    print(f"{'scenario':<40} {'variant':<24} {'step s':>7} {'TPS/GPU':>8} {'comm s':>7} {'exposed s':>9} {'MFU':>5}")
    for r in result["rows"]:
        print(
            f"{r['scenario'][:40]:<40} {r['variant']:<24} {r['step_s']:7.3f} {r['tps_per_gpu']:8.0f} "
            f"{r['comm_s']:7.3f} {r['exposed_comm_s']:9.3f} {r['mfu_at_989'] * 100:4.0f}%"
        )
    print("published, measured by others (8 H100s, selective activation checkpointing, 500 W):")
    for name, (tps, source) in result["published"].items():
        print(f"  {name:<30} {tps:>6} TPS/GPU  ({source})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=2, help="sequences per GPU (torchtitan's local batch: 2)")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--world", type=int, default=None, help="one custom scenario of this many GPUs instead")
    p.add_argument("--hardware", default=None, help="a hardware preset or own numbers (fsdp-overlap's syntax)")
    p.add_argument("--profile", default=None, help="a measured compute profile (gpu_check's compute_profile.json)")
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    result = predict(args)
    print_table(result)
    if args.world is None:
        fitted = at_published_compute(args, result)
        result["at_published_compute"] = fitted
        print()
        print(
            f"the same, with compute at {fitted['calibrated_flops']:.3g} FLOP/s, the rate at which FSDP2 + "
            "torch.compile on one node matches torchtitan's 6,667 TPS/GPU:"
        )
        for r in fitted["rows"]:
            print(f"  {r['scenario'][:40]:<40} {r['variant']:<24} {r['step_s']:7.3f} s {r['tps_per_gpu']:8.0f} TPS/GPU")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
