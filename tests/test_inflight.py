"""Every buffer a collective reads or writes stays alive and untouched from its launch to
its wait, in the code inductor generates for every pass variant (``_inflight.py`` reads
that code; docs/architecture.md, "Buffers in flight")."""

from __future__ import annotations

import pytest
from _dist import run_ranks
from _inflight import inflight_breaches

HEADER = """
cpp_fused_a_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
''')
cpp_fused_b_1 = async_compile.cpp_pybinding(['float*', 'const float*'], r'''
''')
def call(args):
    primals_1, primals_2 = args
    buf0 = empty_strided_cpu((8, ), (1, ), torch.float32)
    cpp_fused_a_0(primals_1, buf0)
    buf1 = torch.ops._c10d_functional.all_to_all_single.default(buf0, [4, 4], [4, 4], '0')
    buf2 = empty_strided_cpu((8, ), (1, ), torch.float32)
"""
WAIT = """    torch.ops._c10d_functional.wait_tensor.default(buf1)
    del buf0
    return (buf1, )
"""


def _breaches(middle: str = "") -> list[str]:
    breaches, windows = inflight_breaches(HEADER + middle + WAIT)
    assert windows == 1
    return breaches


def test_a_clean_window_has_no_breach():
    # compute on other buffers, reading the collective's input: allowed
    assert _breaches("    cpp_fused_a_0(buf0, buf2)\n    cpp_fused_b_1(buf2, primals_2)\n") == []


@pytest.mark.parametrize(
    ("middle", "what"),
    [
        ("    cpp_fused_a_0(primals_2, buf0)\n", "writes buf0 (cpp_fused_a_0)"),
        ("    cpp_fused_b_1(reinterpret_tensor(buf0, (4, ), (1, ), 0), buf2)\n", "writes buf0 (cpp_fused_b_1)"),
        ("    buf3 = reinterpret_tensor(buf0, (2, 4), (4, 1), 0); del buf0  # reuse\n", "reuses buf0"),
        ("    del buf0\n", "frees buf0"),
        ("    extern_kernels.mm(buf2, primals_2, out=buf0)\n", "writes buf0 (out=)"),
        ("    buf0.copy_(buf2)\n", "writes buf0 (in place)"),
        ("    cpp_fused_a_0(buf1, buf2)\n", "reads buf1 before the wait"),
        ("    buf5 = buf1\n    cpp_fused_b_1(buf5, buf2)\n", "writes buf5"),
    ],
    ids=["kernel-write", "alias-write", "reuse", "free", "out", "in-place", "read-output", "output-alias"],
)
def test_each_breach_is_named(middle, what):
    breaches = _breaches(middle)
    assert len(breaches) == 1 and what in breaches[0], breaches
    assert breaches[0].startswith("all_to_all_single at line 10 (buf1)")


def test_a_collective_never_waited_is_a_breach():
    code = HEADER + "    return (buf1, )\n"
    assert inflight_breaches(code) == (["all_to_all_single at line 10 (buf1): never waited"], 1)


def test_the_in_place_all_gather_covers_its_whole_buffer():
    code = (
        HEADER
        + (
            "    buf4 = torch.ops.fsdp_overlap.fill_slot.default([buf2], 2, 0, torch.float32)\n"
            "    torch.ops._c10d_functional.all_gather_into_tensor_out.default("
            "reinterpret_tensor(buf4, (8, ), (1, ), 0), 2, '0', out=buf4)\n"
            "    cpp_fused_b_1(reinterpret_tensor(buf4, (8, ), (1, ), 8), buf2)\n"  # the other slot
            "    torch.ops._c10d_functional.wait_tensor.default(buf4)\n"
        )
        + WAIT
    )
    breaches, windows = inflight_breaches(code)
    assert windows == 2
    assert breaches == ["all_gather_into_tensor_out at line 13 (buf4), line 14: writes buf4 (cpp_fused_b_1)"]


# ----------------------------------------------------------------------------- real code
VARIANTS = {
    "default": {},  # on gloo, 2 ranks: reduce-scatters as receive-first all-to-alls
    "native": {"reduce_scatter_impl": "native"},
    "all_to_all": {"reduce_scatter_impl": "all_to_all"},
    "no_bucketing": {"manual_bucketing": False},
    "passes_off": {"manual_bucketing": False, "overlap_grad_reduce": False},
    "budget": {"max_prefetch_bytes": "1KiB", "prefetch_depth": 2},
    "mixed": {"param_dtype": "bfloat16", "reduce_dtype": "float32", "separate_gather_group": True},
    "checkpointed": {"activation_checkpointing": ["model.layers.0", "model.layers.1"], "reshard_after_forward": False},
}
# The oldest torch of the CI matrix (what the GPU machines carry) compiles the variants whose
# code differs most (the custom exchange op, a prefetch budget, two dtypes and a second group,
# recomputation); the whole suite adds the rest. Two groups, so the matrix compiles half.
GROUPS = {
    "core": ("default", "budget", "mixed", "checkpointed"),
    "rest": ("native", "all_to_all", "no_bucketing", "passes_off"),
}
assert sorted(sum(GROUPS.values(), ())) == sorted(VARIANTS)


def _generated_code(rank: int, world: int, names: tuple[str, ...]) -> dict[str, list[str]]:
    import _hf
    import torch
    from torch._inductor.utils import run_and_get_code

    import fsdp_overlap_plugin as fo

    codes = {}
    ids = _hf.batches(1, 2 * world)[0][2 * rank : 2 * rank + 2]
    for name in names:
        model = _hf.build("llama")
        fo.parallelize(model, dict(VARIANTS[name], backend="inductor"))
        _, codes[name] = run_and_get_code(lambda m=model: m(input_ids=ids, labels=ids).loss.backward())
        torch._dynamo.reset()
    return codes


@pytest.mark.slow
@pytest.mark.parametrize("group", [pytest.param("core", marks=pytest.mark.oldest_torch), "rest"])
def test_generated_code_keeps_every_buffer_in_flight_untouched(tmp_path, group):
    names = GROUPS[group]
    per_rank = run_ranks(_generated_code, names, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}, timeout=900)
    for rank, codes in enumerate(per_rank):
        assert sorted(codes) == sorted(names)
        for name, modules in codes.items():
            assert len(modules) == 2, (name, len(modules))  # the forward and the backward
            for kind, code in zip(("forward", "backward"), modules):
                breaches, windows = inflight_breaches(code)
                assert breaches == [], (rank, name, kind, breaches)
                assert windows >= 2, (rank, name, kind)  # it read the collectives
