"""How the two passes scale with graph size (synthetic FSDP backward graphs, no process
group). Prints a table and the growth exponent of time vs nodes (1.0 = linear).

The passes' cost grows with the number of parameters they merge (each merged parameter
adds a few graph nodes, and creating an FX node costs tens of microseconds in torch
2.13), so the density of parameters matters as much as the node count:

    default   25 nodes per parameter: a transformer backward (this repo's GPT has ~13
              nodes per parameter because of its biases and LayerNorms; a Llama block,
              9 weights in ~250 backward nodes, ~28)
    --dense   9 nodes per parameter: every weight matmul and nothing else (worst case)

    python benchmarks/pass_scaling.py            # 1k .. 100k nodes
    python benchmarks/pass_scaling.py --dense --max-nodes 30000 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time

from fsdp_overlap_plugin.passes import manual_bucketing, overlap_grad_reduce
from fsdp_overlap_plugin.testing import fsdp_backward_graph

PARAMS_PER_BLOCK = 8
BASE_NODES_PER_PARAM = 9  # gather, wait, 2 matmuls, transpose, reduce-scatter, wait, 2 inputs


def build(target_nodes: int, nodes_per_param: int = 25):
    pointwise = max(0, nodes_per_param - BASE_NODES_PER_PARAM)
    blocks = max(1, round(target_nodes / (PARAMS_PER_BLOCK * (BASE_NODES_PER_PARAM + pointwise))))
    gm = fsdp_backward_graph(blocks=blocks, params_per_block=PARAMS_PER_BLOCK, width=8, batch=2, pointwise=pointwise)
    return gm, [f"blocks.{b}" for b in range(blocks)]


def measure(target_nodes: int, nodes_per_param: int) -> dict:
    gm, plan = build(target_nodes, nodes_per_param)
    # FX graphs are cyclic garbage: without this, the previous sizes' graphs are still
    # on the heap and make every garbage-collector pass during the timed region slower
    gc.collect()
    nodes = len(gm.graph.nodes)
    start = time.perf_counter()
    manual_bucketing(gm, plan)  # as the compile wiring runs them: graph only, no recompile
    bucketing = time.perf_counter() - start
    start = time.perf_counter()
    overlap_grad_reduce(gm)
    grad = time.perf_counter() - start
    params = len(plan) * PARAMS_PER_BLOCK
    return {
        "nodes": nodes,
        "params": params,
        "buckets": len(plan),
        "bucketing_s": bucketing,
        "grad_overlap_s": grad,
        "total_s": bucketing + grad,
    }


def slope(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-nodes", type=int, default=100_000)
    parser.add_argument("--dense", action="store_true", help="9 nodes per parameter (worst case) instead of 25")
    parser.add_argument("--json", help="also write the rows and exponents to this file")
    args = parser.parse_args()
    density = BASE_NODES_PER_PARAM if args.dense else 25
    sizes = [n for n in (1_000, 3_000, 10_000, 30_000, 100_000) if n <= args.max_nodes]
    rows = [measure(n, density) for n in sizes]
    print(f"synthetic FSDP backward graphs, {density} nodes per parameter, {PARAMS_PER_BLOCK} parameters per bucket")
    print(f"{'nodes':>8} {'params':>7} {'buckets':>8} {'bucketing s':>12} {'grad-overlap s':>15} {'total s':>9}")
    for r in rows:
        print(
            f"{r['nodes']:>8} {r['params']:>7} {r['buckets']:>8} {r['bucketing_s']:>12.3f} "
            f"{r['grad_overlap_s']:>15.3f} {r['total_s']:>9.3f}"
        )
    exps = {}
    if len(rows) >= 2:
        xs = [r["nodes"] for r in rows]
        for key in ("bucketing_s", "grad_overlap_s", "total_s"):
            exps[key] = slope(xs, [max(r[key], 1e-6) for r in rows])
        print("growth exponent (time ~ nodes^k): " + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in exps.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "exponents": exps}, f, indent=2)


if __name__ == "__main__":
    main()
