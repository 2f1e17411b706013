"""Our passes beside the real torch_npu ones: the registry's torch-npu 2.14.0 wheel, its
``AscendCustomPostPass`` installed as torch_npu installs it, on 2 gloo ranks with inductor.

Checked: on every compiled graph the Ascend pass runs first and ours second; the details
inductor hashes into its FX graph cache key hold both passes' ``uuid()``; the cache stays
on (a miss, never a bypass); training matches a single-process reference. Only the device
queries and the C extension's operators are faked (tests/_npu_sources.py).

Runs where its sources belong: torch 2.14, with ``FSDP_OVERLAP_TORCH_NPU_WHEEL`` naming the
wheel; ``.ci/test-torch 2.14.1`` (part of ``.ci/run``) downloads it and sets both.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from _dist import run_ranks
from _train import full_params, make_model, train_reference, train_sharded

WHEEL = os.environ.get("FSDP_OVERLAP_TORCH_NPU_WHEEL")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.middle_torch,  # CI's 2.14 leg: torch-npu 2.14.0's release
    pytest.mark.skipif(
        not torch.__version__.startswith("2.14."),
        reason=f"torch-npu 2.14.0's passes are written for torch 2.14, this is {torch.__version__}: "
        "`.ci/test-torch 2.14.1` (part of .ci/run) runs these",
    ),
    pytest.mark.skipif(
        WHEEL is None, reason="FSDP_OVERLAP_TORCH_NPU_WHEEL is unset (`.ci/test-torch 2.14.1` downloads the wheel)"
    ),
]


def _train_beside_ascend(rank: int, world: int, root: str, cache: str) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    torch._dynamo.reset()
    # the plugin (and Lightning, Accelerate) first: they must not take the half-loaded
    # torch_npu for an installed one and pick NPU devices
    from _npu_sources import load_ascend_passes
    from torch._inductor import config as inductor_config
    from torch._inductor.codecache import FxGraphHashDetails

    import fsdp_overlap_plugin as fo

    graph_match_pass = load_ascend_passes(Path(root))
    graph_match_pass.post_grad_custom_pass_fuc()  # what importing torch_npu._inductor does
    installed = inductor_config.post_grad_custom_post_pass
    from torch_npu._inductor.fx_passes import ascend_custom_passes

    events: list[tuple[str, int]] = []
    hashed: list = []
    run_ascend = ascend_custom_passes.run_register_post_custom_passes

    def ascend_spy(graph):  # AscendCustomPostPass.__call__ looks this name up on each call
        events.append(("ascend", id(graph)))
        details = object.__new__(FxGraphHashDetails)  # its pass-detail method reads no state
        hashed.append(details._get_custom_pass_detail(inductor_config.post_grad_custom_post_pass))
        return run_ascend(graph)

    ascend_custom_passes.run_register_post_custom_passes = ascend_spy
    from fsdp_overlap_plugin.compile import backends as compile_module
    from fsdp_overlap_plugin.runtime.state import get_state

    run_ours = compile_module.run_passes

    def ours_spy(gm, kind, state, **kwargs):
        events.append(("ours", id(gm.graph)))
        return run_ours(gm, kind, state, **kwargs)

    compile_module.run_passes = ours_spy  # before parallelize: the inductor backend takes it then
    try:
        model = make_model()
        reference = train_reference(model) if rank == 0 else None
        fo.parallelize(model, backend="inductor")
        losses = train_sharded(model, rank, world)
    finally:
        compile_module.run_passes = run_ours
        ascend_custom_passes.run_register_post_custom_passes = run_ascend
    state = get_state(model)
    return {
        "events": events,
        "hashed": hashed,
        "ascend_uuid": installed.uuid(),
        "our_uuid": "fsdp-overlap-post-grad-" + state.cache_key(),
        "compile_cache": state.compile_cache,
        "losses": losses,
        "params": full_params(model),
        "reference": reference,
        "report": fo.schedule_report(model),
    }


def test_the_real_ascend_pass_runs_first_then_ours_and_both_key_the_cache(tmp_path):
    from _npu_sources import extract

    assert Path(WHEEL).is_file(), f"FSDP_OVERLAP_TORCH_NPU_WHEEL={WHEEL} is not a file"
    root = extract(WHEEL, tmp_path / "wheel")
    results = run_ranks(_train_beside_ascend, str(root), str(tmp_path / "inductor"), timeout=600)
    for rank, result in enumerate(results):
        events = result["events"]
        graphs = list(dict.fromkeys(graph for _, graph in events))
        assert len(graphs) >= 2, events  # a forward and a backward at least
        for graph in graphs:  # per graph: Ascend's pass, then ours, once each
            assert [who for who, g in events if g == graph] == ["ascend", "ours"], (rank, events)
        for details in result["hashed"]:
            assert details == (result["ascend_uuid"], result["our_uuid"]), (rank, details)
        for use in result["compile_cache"]:
            assert use["fx_graph"]["bypass"] == 0 and use["fx_graph"]["miss"] > 0, (rank, use)
        report = result["report"]
        assert report["forward"]["after"]["all_gather"] < report["forward"]["before"]["all_gather"]
    losses, params = results[0]["reference"]
    for got, want in zip(results[0]["losses"], losses):
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6), (results[0]["losses"], losses)
    for name, want in params.items():
        torch.testing.assert_close(results[0]["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)
