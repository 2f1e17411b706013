"""Two ranks of a fake process group in one process: the graphs gpt_small compiles to,
with the passes on, and what the passes must have made of them. Shared by the GPU test
(tests/bench/test_gpu_cuda.py, CUDA tensors) and its CPU twin (tests/bench/test_gpu_check.py)."""

from __future__ import annotations

import torch
from _fake import GraphCapture, fake_world
from torch.distributed.device_mesh import init_device_mesh

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn
from fsdp_overlap_plugin.passes.graph import group_name, is_all_gather, is_reduce_scatter, wait_of

N_PARAMS = 53  # gpt_small: 2 embeddings + 4 blocks x 12 + norm 2 + head 1


def two_rank_graphs(monkeypatch, device_type: str, **config) -> dict:
    """gpt_small compiled (aot_eager, passes on) for rank 0 of a fake 2-rank world on
    ``device_type``, one step run; each graph's collectives before and after the passes,
    in graph order, as (bucket, launch index, wait index, group, device)."""
    capture = GraphCapture(monkeypatch)
    with fake_world(2):
        device = torch.device(device_type, 0) if device_type != "cpu" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        mesh = init_device_mesh(device_type, (2,), mesh_dim_names=("shard",))
        torch.manual_seed(0)
        with torch.device(device):
            model = gpt_small()
        fo.parallelize(model, mesh=mesh, backend="aot_eager", **config)
        x, y = (t.to(device) for t in fixed_batches(1, 2, 16, 256)[0])
        loss_fn(model(x), y).backward()
        report = fo.schedule_report(model)
    graphs = {}
    for kind in ("forward", "backward"):
        for which in ("before", "after"):
            gm = capture.get(kind, which)
            index = {n: i for i, n in enumerate(gm.graph.nodes)}
            graphs[kind, which] = {
                name: [
                    (
                        n.meta.get("fsdp_overlap_bucket"),
                        index[n],
                        index[wait_of(n)],
                        group_name(n),
                        n.meta["val"].device,
                    )
                    for n in gm.graph.nodes
                    if pred(n)
                ]
                for name, pred in (("all_gather", is_all_gather), ("reduce_scatter", is_reduce_scatter))
            }
    return {"graphs": graphs, "report": report}


def check_two_rank_graphs(result: dict, device_type: str) -> None:
    """One all-gather per plan entry in the forward and one reduce-scatter per entry in
    the backward, each bucket's all-gather launched before the previous bucket's wait,
    and the all-gathers on their own group (the NCCL default), on ``device_type``."""
    graphs, report = result["graphs"], result["report"]
    plan = report["plan"]
    assert report["device_type"] == device_type and report["world_size"] == 2
    assert len(plan) == 6, plan  # tok_emb + pos_emb, 4 blocks, norm + head
    # before the passes: one collective per parameter
    assert len(graphs["forward", "before"]["all_gather"]) == N_PARAMS
    assert len(graphs["backward", "before"]["reduce_scatter"]) == N_PARAMS
    forward = graphs["forward", "after"]["all_gather"]
    assert [bucket for bucket, *_ in forward] == list(range(len(plan)))
    assert all(launch < prev_wait for (_, launch, *_), (_, _, prev_wait, *_) in zip(forward[1:], forward)), forward
    # backward: resharded blocks re-gathered last to first, prefetched the same way; not
    # the embeddings (their backward reads only the indices), nor the two buckets the
    # forward keeps gathered: the last (norm + head, 256 x 64 weights) and, as that one
    # gathers fewer bytes than a block (12 x 64 x 64 weights), blocks.3 before it, so the
    # backward's first re-gather (blocks.2) hides behind blocks.3's gradients. Every
    # bucket's gradients in one reduce-scatter, last bucket first
    gathers = graphs["backward", "after"]["all_gather"]
    assert [bucket for bucket, *_ in gathers] == [3, 2, 1]
    assert all(launch < prev_wait for (_, launch, *_), (_, _, prev_wait, *_) in zip(gathers[1:], gathers)), gathers
    scatters = graphs["backward", "after"]["reduce_scatter"]
    assert [bucket for bucket, *_ in scatters] == list(reversed(range(len(plan))))
    for kind in ("forward", "backward"):
        stats = report[kind]["passes"]["manual_bucketing"]
        assert stats["unbucketed_all_gathers"] == stats["unbucketed_reduce_scatters"] == 0
    collectives = forward + gathers + scatters
    assert {device.type for *_, device in collectives} == {device_type}
    assert len({group for *_, group, _ in forward + gathers}) == 1
    assert {group for *_, group, _ in forward + gathers}.isdisjoint({group for *_, group, _ in scatters})
