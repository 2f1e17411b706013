"""How the passes scale with graph size. Prints a table and the growth exponent of time
vs nodes (1.0 = linear).

Synthetic mode (the default): hand-built FSDP backward graphs, no process group.

The passes' cost grows with the number of parameters they merge (each merged parameter
adds a few graph nodes, and creating an FX node costs tens of microseconds in torch
2.13), so the density of parameters matters as much as the node count:

    default   25 nodes per parameter: a transformer backward (this repo's GPT has ~13
              nodes per parameter because of its biases and LayerNorms; a Llama block,
              9 weights in ~250 backward nodes, ~28)
    --dense   9 nodes per parameter: every weight matmul and nothing else (worst case)

--real: the post-grad forward and backward graphs of a transformers LlamaForCausalLM
(hidden size 64, tied embeddings), sharded with ``parallelize`` on a fake process group of
world size 2 and compiled with inductor, captured exactly as ``compile.run_passes``
receives them (tracing a 64-layer model takes a few minutes on one core). Every pass the
compile wiring applies (``POST_GRAD_PASSES``: tied, manual_bucketing, overlap_grad_reduce,
pin_order) is timed on fresh copies of the captured graph; ``--save-signature`` /
``--check-signature`` write or compare the graphs the passes produce (node order, targets,
arguments), to prove an optimisation changed nothing.

    python benchmarks/pass_scaling.py            # 1k .. 100k nodes
    python benchmarks/pass_scaling.py --dense --max-nodes 30000 --json out.json
    python benchmarks/pass_scaling.py --real --layers 8,24,64 [--repeat 5]
    python benchmarks/pass_scaling.py --real --layers 8,24 --save-signature sig.json
    python benchmarks/pass_scaling.py --real --layers 8,24 --check-signature sig.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import math
import time
from typing import Any

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


# --------------------------------------------------------------------------- real graphs
REAL_HIDDEN = 64


class _Captured(Exception):
    """Raised from the backward's pass hook once both graphs are captured: nothing after
    that (the backward's lowering and code generation) is needed."""


def llama_config(layers: int, hidden: int = REAL_HIDDEN):
    """The real graphs' Llama: 4 heads / 2 kv heads, MLP 2 x hidden, vocabulary 128, tied."""
    from _harness import models

    return models.llama_config(hidden, layers, 4, 2, 2 * hidden, 128, 64, tied=True)


def capture_real(layers: int, hidden: int = REAL_HIDDEN, seq: int = 16, batch: int = 2, **config) -> dict[str, Any]:
    """``{"forward": (gm, state), "backward": (gm, state)}``: copies of the post-grad graphs
    of one training step of a ``layers``-layer Llama, as ``run_passes`` receives them
    (before any pass ran), with the ``OverlapState`` the wiring passes with them.

    Runs on a fake process group of world size 2 (created here unless one exists).
    ``config`` overrides the ``OverlapConfig`` (default: inductor, every pass on)."""
    import torch
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp_overlap_plugin as fo
    import fsdp_overlap_plugin.compile.backends as fo_compile

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    from _harness.models import build_llama

    captured: dict[str, Any] = {}

    def hook(gm, kind, state, **kwargs):
        captured[kind] = (copy.deepcopy(gm), state)
        if kind == "backward":
            raise _Captured()
        return {}  # the forward is compiled without our passes: the backward does not depend on them

    original = fo_compile.run_passes
    torch._dynamo.reset()
    fo_compile.run_passes = hook
    try:
        # no FX graph cache: a hit would skip the post-grad passes, so nothing would be captured
        with (
            torch._inductor.config.patch(fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
        ):
            model = build_llama(llama_config(layers, hidden), seed=0, direct=True)
            fo.parallelize(model, {"backend": "inductor", **config})
            x = torch.randint(0, model.config.vocab_size, (batch, seq))
            try:
                model(input_ids=x, labels=x).loss.backward()
            except Exception:
                if "backward" not in captured:
                    raise
    finally:
        fo_compile.run_passes = original
        torch._dynamo.reset()
        if created:
            dist.destroy_process_group()
    return captured


def applicable_passes(kind: str, state) -> list:
    """The ``POST_GRAD_PASSES`` entries the wiring runs on a graph of this kind."""
    from fsdp_overlap_plugin.compile.pass_table import POST_GRAD_PASSES

    return [e for e in POST_GRAD_PASSES if e.applies_to(kind, state)]


def run_real_passes(gm, kind: str, state) -> tuple[dict[str, float], dict[str, dict]]:
    """Run the applicable passes on ``gm`` in place: (seconds per pass, statistics per pass)."""
    times, stats = {}, {}
    for entry in applicable_passes(kind, state):
        start = time.perf_counter()
        stats[entry.name] = entry.pass_fn(gm, state)
        times[entry.name] = time.perf_counter() - start
    return times, stats


def time_run_passes(gm, kind: str, state) -> float:
    """Seconds of the whole ``compile.run_passes`` on a fresh copy of ``gm``, called as the
    inductor wiring calls it (``inductor_passes.py``: ``recompile=False``, since inductor
    regenerates the graph's code itself after its custom passes): the passes plus the
    wiring's own work (schedule events and collective counts before and after, linting the
    graph once); the record is not written to disk."""
    import fsdp_overlap_plugin.compile.pass_table as fo_compile

    work = copy.deepcopy(gm)
    gc.collect()
    saved, records = fo_compile.save_record, len(state.records)
    fo_compile.save_record = lambda *args, **kwargs: None
    try:
        start = time.perf_counter()
        fo_compile.run_passes(work, kind, state, recompile=False)
        return time.perf_counter() - start
    finally:
        fo_compile.save_record = saved
        del state.records[records:]


def graph_signature(gm) -> list[str]:
    """One line per node, in graph order: name, op, target, arguments (nodes by name) and
    our ``fsdp_overlap_*`` metadata. Equal signatures: the passes built the same graph."""
    import torch.fx as fx

    def arg(a):
        return fx.node.map_arg(a, lambda n: f"%{n.name}")

    lines = []
    for node in gm.graph.nodes:
        ours = sorted((k, repr(v)) for k, v in node.meta.items() if k.startswith("fsdp_overlap"))
        lines.append(f"{node.name} {node.op} {node.target} {arg(node.args)!r} {arg(node.kwargs)!r} {ours}")
    for name, sub in sorted(gm.named_children()):  # control_deps subgraphs (pin_order)
        if hasattr(sub, "graph"):
            lines.extend(f"[{name}] {line}" for line in graph_signature(sub))
    return lines


def measure_real(layers: int, repeat: int, hidden: int = REAL_HIDDEN) -> tuple[list[dict], dict[str, list[str]]]:
    """Rows (one per graph kind) and the signature of each graph after the passes."""
    start = time.perf_counter()
    captured = capture_real(layers, hidden)
    traced_s = time.perf_counter() - start
    rows, signatures = [], {}
    for kind in ("forward", "backward"):
        gm, state = captured[kind]
        runs = []
        for _ in range(repeat):
            work = copy.deepcopy(gm)
            gc.collect()
            times, stats = run_real_passes(work, kind, state)
            runs.append(times)
        names = list(runs[0])
        wiring = [time_run_passes(gm, kind, state) for _ in range(repeat)]
        per_pass = {name: min(r[name] for r in runs) for name in names}
        rows.append(
            {
                "layers": layers,
                "graph": kind,
                "nodes": len(gm.graph.nodes),
                "nodes_after": len(work.graph.nodes),
                "passes_s": per_pass,
                "total_s": min(sum(r.values()) for r in runs),
                "run_passes_s": min(wiring),
                "trace_s": traced_s,
                "stats": {k: {s: v for s, v in st.items() if isinstance(v, (int, float))} for k, st in stats.items()},
            }
        )
        signatures[kind] = graph_signature(work)
    return rows, signatures


def real_main(args) -> None:
    import torch

    torch.set_num_threads(1)
    layer_counts = [int(x) for x in args.layers.split(",")]
    rows, signatures = [], {}
    for layers in layer_counts:
        r, sig = measure_real(layers, args.repeat, args.hidden)
        rows.extend(r)
        signatures[str(layers)] = sig
    from fsdp_overlap_plugin.compile.pass_table import POST_GRAD_PASSES

    seen = {n for r in rows for n in r["passes_s"]}
    pass_names = [e.name for e in POST_GRAD_PASSES if e.name in seen]
    print(
        f"real post-grad graphs: transformers LlamaForCausalLM, hidden {args.hidden}, tied embeddings, "
        f"fake process group of world size 2, inductor; best of {args.repeat} runs on fresh copies"
    )
    header = f"{'layers':>6} {'graph':>8} {'nodes':>7} " + " ".join(
        f"{n + ' s':>{max(len(n) + 2, 9)}}" for n in pass_names
    )
    print(header + f" {'total s':>8} {'s/10k nodes':>11} {'run_passes s':>12} {'s/10k nodes':>11}")
    for r in rows:
        cells = " ".join(
            f"{r['passes_s'][n]:>{max(len(n) + 2, 9)}.3f}" if n in r["passes_s"] else f"{'-':>{max(len(n) + 2, 9)}}"
            for n in pass_names
        )
        print(
            f"{r['layers']:>6} {r['graph']:>8} {r['nodes']:>7} {cells} {r['total_s']:>8.3f} "
            f"{r['total_s'] / r['nodes'] * 1e4:>11.3f} {r['run_passes_s']:>12.3f} "
            f"{r['run_passes_s'] / r['nodes'] * 1e4:>11.3f}"
        )
    exps = {}
    for kind in ("forward", "backward"):
        sel = [r for r in rows if r["graph"] == kind]
        if len(sel) >= 2:
            exps[kind] = slope([r["nodes"] for r in sel], [max(r["total_s"], 1e-6) for r in sel])
    both = {}
    for r in rows:
        n, t = both.get(r["layers"], (0, 0.0))
        both[r["layers"]] = (n + r["nodes"], t + r["total_s"])
    if len(both) >= 2:
        exps["both"] = slope([n for n, _ in both.values()], [max(t, 1e-6) for _, t in both.values()])
        wiring = {}
        for r in rows:
            wiring[r["layers"]] = wiring.get(r["layers"], 0.0) + r["run_passes_s"]
        exps["run_passes"] = slope([n for n, _ in both.values()], [max(wiring[k], 1e-6) for k in both])
    nodes_all = sum(n for n, _ in both.values())
    time_all = sum(t for _, t in both.values())
    wiring_all = sum(r["run_passes_s"] for r in rows)
    print(
        f"all graphs: passes {time_all / nodes_all * 1e4:.3f} s per 10k nodes, "
        f"run_passes as inductor runs it (passes + events, counts, lint) {wiring_all / nodes_all * 1e4:.3f} s per 10k nodes"
    )
    if exps:
        print("growth exponent (time ~ nodes^k): " + ", ".join(f"{k} {v:.2f}" for k, v in exps.items()))
    digests = {
        layers: {kind: hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16] for kind, lines in sig.items()}
        for layers, sig in signatures.items()
    }
    print("output graph signatures: " + ", ".join(f"{n}L {k} {d}" for n, kd in digests.items() for k, d in kd.items()))
    if args.save_signature:
        with open(args.save_signature, "w") as f:
            json.dump(signatures, f)
    if args.check_signature:
        with open(args.check_signature) as f:
            reference = json.load(f)
        bad = []
        for layers, sig in signatures.items():
            for kind, lines in sig.items():
                ref = reference.get(layers, {}).get(kind)
                if ref is None:
                    continue
                if ref != lines:
                    first = next((i for i, (a, b) in enumerate(zip(ref, lines)) if a != b), min(len(ref), len(lines)))
                    bad.append(f"{layers}L {kind}: differs at line {first}")
        print("signature check: " + ("identical to " + args.check_signature if not bad else "; ".join(bad)))
        if bad:
            raise SystemExit(1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "exponents": exps}, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-nodes", type=int, default=100_000)
    parser.add_argument("--dense", action="store_true", help="9 nodes per parameter (worst case) instead of 25")
    parser.add_argument("--json", help="also write the rows and exponents to this file")
    parser.add_argument("--real", action="store_true", help="traced Llama graphs instead of synthetic ones")
    parser.add_argument("--layers", default="8,24,64", help="--real: layer counts, comma-separated")
    parser.add_argument("--hidden", type=int, default=REAL_HIDDEN, help="--real: hidden size")
    parser.add_argument("--repeat", type=int, default=3, help="--real: timed runs per graph (the best is shown)")
    parser.add_argument("--save-signature", help="--real: write the output graphs' signatures here")
    parser.add_argument("--check-signature", help="--real: compare the output graphs with these signatures")
    args = parser.parse_args()
    if args.real:
        real_main(args)
        return
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
