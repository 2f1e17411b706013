"""Every buffer a collective reads or writes stays alive and untouched from its launch to
its wait, in the code inductor generates for every pass variant (``_inflight.py`` reads
that code; docs/architecture.md, "Buffers in flight")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _dist import run_ranks
from _inflight import inflight_breaches

pytestmark = pytest.mark.torch_sensitive  # its quick tests read the op schemas of the torch that runs them

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


@pytest.mark.parametrize(
    "check",
    [
        "assert_size_stride(buf0, (8, ), (1, ), 'op')",
        "assert_tensor_metadata(buf0, (8, ), (1, ), torch.float32, 'op')",
        "assert_alignment(buf0, 16, 'op')",
    ],
)
def test_checks_of_a_buffers_metadata_do_not_touch_it(check):
    # inductor's asserts after an op read sizes, strides, dtype or the address (torch 2.14
    # writes assert_tensor_metadata, with the dtype, after a custom op)
    assert _breaches(f"    {check}\n") == []


def test_a_collective_never_waited_is_a_breach():
    code = HEADER + "    return (buf1, )\n"
    assert inflight_breaches(code) == (["all_to_all_single at line 10 (buf1): never waited"], 1)


def test_a_module_without_its_call_function_is_an_error():
    with pytest.raises(ValueError, match="expected one `def call` in the generated module, found 0"):
        inflight_breaches("buf0 = torch.ops._c10d_functional.all_reduce.default(x, 'sum', '0')\n")


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


# ------------------------------------------------------- breaches in real generated code
# Modules inductor generated (torch 2.13, C++ kernel sources left out) for the tied Llama of
# the real-code tests below: the default variant's forward (two unmerged all-gathers, two
# merged in-place ones) and the 2x2 HSDP backward (an in-place all-gather, receive-first
# all-to-alls, in-place replica all-reduces). To regenerate: ``_compile("default", 0, 2)`` /
# ``_compile("hsdp", 0, 4)`` under ``fake_world``, each kernel's ``r'''...'''`` source cut.
FIXTURES = Path(__file__).parents[1] / "fixtures" / "inflight"
LAUNCH = re.compile(r"^\s*(?:\w+ = )?torch\.ops\._c10d_functional\.(?!wait_tensor\b)\w+\.default\(", re.M)


def launches(code: str) -> int:
    """The collectives launched in ``code``, counted apart from the checker: one per line
    that calls a ``_c10d_functional`` op other than ``wait_tensor``."""
    return len(LAUNCH.findall(code))


WAIT_CALL = re.compile(r"^\s*torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)", re.M)


def wait_calls(code: str) -> tuple[int, int]:
    """The ``wait_tensor`` calls in ``code`` and the buffers they wait, counted apart from the
    checker. torch 2.14 waits a tied weight's one all-gather twice (once per use) where
    ``manual_bucketing`` is off: a second wait on a finished collective, which does nothing."""
    found = WAIT_CALL.findall(code)
    return len(found), len(set(found))


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def _line_of(code: str, text: str, after: int = 0) -> int:
    """The 1-based number of the first line after line ``after`` whose stripped text is ``text``."""
    lines = code.splitlines()
    return next(i + 1 for i in range(after, len(lines)) if lines[i].strip() == text)


def _insert(code: str, line: int, text: str) -> str:
    """``text`` (lines, indented as the function body) inserted after line ``line``."""
    lines = code.splitlines()
    body = ["        " + t for t in text.splitlines()]
    return "\n".join(lines[:line] + body + lines[line:]) + "\n"


FORWARD = _fixture("default_forward.txt")
GATHER = "buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_2, 2, '0')"
MERGED = (
    "torch.ops._c10d_functional.all_gather_into_tensor_out.default("
    "reinterpret_tensor(buf2, (4640, ), (1, ), 0), 2, '0', out=buf2)"
)
G0 = f"all_gather_into_tensor at line {_line_of(FORWARD, GATHER)} (buf0)"  # reads primals_2, writes buf0
G2 = f"all_gather_into_tensor_out at line {_line_of(FORWARD, MERGED)} (buf2)"  # buf2 = buf1 (fill_slot's)
AT = _line_of(FORWARD, MERGED)  # inserted code lands inside both windows: buf0's and buf2's
ALIAS = "buf6 = {}\n{}"


def test_real_modules_have_no_breach_and_every_collective_is_checked():
    for name, count in (("default_forward.txt", 4), ("hsdp_backward.txt", 9)):
        code = _fixture(name)
        assert launches(code) == count
        assert inflight_breaches(code) == ([], count), name


@pytest.mark.parametrize(
    ("middle", "window", "what"),
    [
        # (a) an extern kernel reads a collective's output before its wait
        ("extern_kernels.mm(buf1, primals_2, out=buf7)", G2, "reads buf1 before the wait (extern_kernels.mm)"),
        ("extern_kernels.mm(buf0, primals_3, out=buf7)", G0, "reads buf0 before the wait (extern_kernels.mm)"),
        # (b) extern and aten kernels write a collective's input
        (
            "extern_kernels.addmm(primals_5, primals_7, primals_9, alpha=1, beta=1, out=primals_2)",
            G0,
            "writes primals_2 (out=)",
        ),
        (
            "torch.ops.aten.add.out(primals_5, primals_7, out=reinterpret_tensor(buf2, (16, ), (1, ), 0))",
            G2,
            "writes buf2 (aten.add.out)",
        ),
        (
            "torch.ops.aten.index_put_.default(buf1, [primals_1], primals_4)",
            G2,
            "writes buf1 (aten.index_put_.default)",
        ),
        # (c) aten ops read the output
        ("buf9 = torch.ops.aten.sum.default(buf1)", G2, "reads buf1 before the wait (aten.sum.default)"),
        ("buf9 = aten.mm.default(buf0, primals_3)", G0, "reads buf0 before the wait (aten.mm.default)"),
        # (d) aliases of the buffer, then the alias read or written
        (ALIAS.format("buf1[:4]", "buf6.copy_(primals_5)"), G2, "writes buf6 (in place)"),
        (
            ALIAS.format("buf2.view(98, 32)", "buf9 = torch.ops.aten.sum.default(buf6)"),
            G2,
            "reads buf6 before the wait (aten.sum.default)",
        ),
        (
            ALIAS.format(
                "torch.ops.aten.slice.Tensor(buf2, 0, 0, 4)",
                "torch.ops.aten.index_put_.default(buf6, [primals_1], primals_4)",
            ),
            G2,
            "writes buf6 (aten.index_put_.default)",
        ),
        (
            ALIAS.format(
                "torch.ops.aten.as_strided.default(buf0, [4], [1])", "extern_kernels.mm(buf6, primals_3, out=buf7)"
            ),
            G0,
            "reads buf6 before the wait (extern_kernels.mm)",
        ),
        # anything the checker cannot classify counts as a write, and a view's name freed
        ("some_helper(buf2)", G2, "touches buf2 (unknown call some_helper: counted as a write)"),
        ("primals_2.foo()", G0, "touches primals_2 (foo: counted as a write)"),
        ("buf6 = buf2.T\ndel buf6", G2, "frees buf6"),
    ],
    ids=[
        "a-mm-reads-alias",
        "a-mm-reads-output",
        "b-addmm-out-input",
        "b-aten-out-input",
        "b-index_put_",
        "c-sum",
        "c-aten-mm",
        "d-slice-written",
        "d-view-read",
        "d-aten-slice-written",
        "d-as_strided-read",
        "unknown-call",
        "unknown-method",
        "alias-freed",
    ],
)
def test_each_breach_in_real_code_is_caught(middle, window, what):
    code = _insert(FORWARD, AT, middle)
    breaches, windows = inflight_breaches(code)
    line = AT + len(middle.splitlines())
    assert breaches == [f"{window}, line {line}: {what}"]
    assert windows == 4


def test_reading_a_collectives_input_in_flight_is_allowed():
    # primals_2, buf0's input, is only read (the gather sends it); the merged gather's input
    # is a slot of its output buf2 (= buf1), which receives the other slots: reading it is not
    middle = "buf9 = torch.ops.aten.sum.default(primals_2)\nextern_kernels.mm(reinterpret_tensor(buf1, (4, 4), (4, 1), 0), primals_3, out=buf7)"
    assert inflight_breaches(_insert(FORWARD, AT, middle)) == (
        [f"{G2}, line {AT + 2}: reads buf1 before the wait (extern_kernels.mm)"],
        4,
    )
    assert inflight_breaches(_insert(FORWARD, AT, middle.splitlines()[0])) == ([], 4)


def test_e_a_second_collective_into_a_storage_in_flight():
    second = "torch.ops._c10d_functional.all_gather_into_tensor_out.default(reinterpret_tensor(buf1, (4640, ), (1, ), 4640), 2, '0', out=buf1)"
    breaches, windows = inflight_breaches(_insert(FORWARD, AT, second))
    assert windows == 5
    hits = "reads buf1 before the wait (_c10d_functional.all_gather_into_tensor_out.default); writes buf1 (_c10d_functional.all_gather_into_tensor_out.default)"
    assert breaches == [f"{G2}, line {AT + 1}: {hits}"]


def test_e_a_second_launch_and_wait_on_a_reused_buffer_is_checked_in_its_own_window():
    # buf2 gathered and waited; then all-reduced in place and read by split_gathered before
    # that second wait (the first wait of the storage is not the second launch's wait)
    first_wait = _line_of(FORWARD, "torch.ops._c10d_functional.wait_tensor.default(buf2)")
    code = _insert(FORWARD, first_wait, "torch.ops._c10d_functional.all_reduce_.default(buf2, 'sum', '0')")
    split = next(
        i + 1 for i, line in enumerate(code.splitlines()) if "buf18 = torch.ops.fsdp_overlap.split_gathered" in line
    )
    code = _insert(code, split, "torch.ops._c10d_functional.wait_tensor.default(buf2)")
    breaches, windows = inflight_breaches(code)
    assert windows == 5
    reduce = f"all_reduce_ at line {first_wait + 1} (buf2)"
    assert breaches == [f"{reduce}, line {split}: reads buf2 before the wait (fsdp_overlap.split_gathered.default)"]


def test_hsdp_replica_all_reduce_window():
    code = _fixture("hsdp_backward.txt")
    launch = _line_of(code, "torch.ops._c10d_functional.all_reduce_.default(buf50, 'avg', '1')")
    reduce = f"all_reduce_ at line {launch} (buf50)"
    read = _insert(code, launch, "buf9 = torch.ops.aten.sum.default(reinterpret_tensor(buf50, (4, ), (1, ), 0))")
    assert inflight_breaches(read) == (
        [f"{reduce}, line {launch + 1}: reads buf50 before the wait (aten.sum.default)"],
        9,
    )
    written = _insert(code, launch, "cpp_fused_all_reduce_10(buf13, buf50)")  # its second argument is `float*`
    assert inflight_breaches(written)[0] == [f"{reduce}, line {launch + 1}: writes buf50 (cpp_fused_all_reduce_10)"]


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
    "hsdp": {"mesh": {"replicate": 2, "shard": 2}},  # 4 ranks: the replica all-reduces
}
WORLD = {"hsdp": 4}
# Per test: the variants compiled on the 2 real gloo ranks, then the variants each rank
# compiles alone on a fake process group (the same generated code: on a CPU, ``auto`` takes
# the receive-first exchange on "fake" as on gloo; the default variant's code is the same
# text on both). Two gloo ranks compiling one variant share its C++ kernels (inductor's
# cache, one compile per kernel), so the variants with kernels of their own (bf16, the
# prefetch budget, recomputation) stay there; the rest compile one per rank at once, with no
# second rank repeating the tracing. The oldest torch of the CI matrix (what the GPU machines
# carry) compiles the variants whose code differs most (the custom exchange op on gloo, a
# prefetch budget, two dtypes and a second group, recomputation); 2.14, the first torch whose
# inductor runs a distributed pass of its own by default, the rest.
GROUPS = {
    "core": (("default", "budget", "mixed", "checkpointed"), ((), ())),
    "rest": ((), (("hsdp", "native"), ("all_to_all", "no_bucketing", "passes_off"))),
}
assert sorted(n for gloo, fake in GROUPS.values() for n in gloo + sum(fake, ())) == sorted(VARIANTS)


def _compile(name: str, rank: int, world: int) -> tuple[list[str], list[int]]:
    """The forward's and the backward's generated code under variant ``name``, and the
    waits (one per collective) the plugin counted in each post-pass FX graph."""
    import _hf
    import torch
    from torch._inductor.utils import run_and_get_code

    import fsdp_overlap_plugin as fo

    ids = _hf.batches(1, 2 * world)[0][2 * rank : 2 * rank + 2]
    model = _hf.build("llama")
    fo.parallelize(model, dict(VARIANTS[name], backend="inductor"))
    _, codes = run_and_get_code(lambda: model(input_ids=ids, labels=ids).loss.backward())
    report = fo.schedule_report(model)
    torch._dynamo.reset()
    return codes, [report[kind]["after"]["wait"] for kind in ("forward", "backward")]


def _generated_code(rank: int, world: int, gloo: tuple[str, ...], fake: tuple[tuple[str, ...], ...]) -> dict:
    import torch.distributed as dist
    from _fake import fake_world

    out = {name: _compile(name, rank, world) for name in gloo}
    dist.destroy_process_group()
    for name in fake[rank]:
        with fake_world(WORLD.get(name, 2)):
            out[name] = _compile(name, 0, WORLD.get(name, 2))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "group",
    [pytest.param("core", marks=pytest.mark.oldest_torch), pytest.param("rest", marks=pytest.mark.middle_torch)],
)
def test_generated_code_keeps_every_buffer_in_flight_untouched(tmp_path, group):
    gloo, fake = GROUPS[group]
    per_rank = run_ranks(_generated_code, gloo, fake, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}, timeout=900)
    checked = {}
    for rank, results in enumerate(per_rank):
        assert sorted(results) == sorted(gloo + fake[rank])
        for name, (modules, waits) in results.items():
            assert len(modules) == 2, (name, len(modules))  # the forward and the backward
            for kind, code, count in zip(("forward", "backward"), modules, waits):
                breaches, windows = inflight_breaches(code)
                assert breaches == [], (rank, name, kind, breaches)
                # every collective of the graph checked: as many windows as the code has
                # launches and waited buffers, each counted without the checker; the waits
                # are the FX graph's (the plugin's count)
                calls, waited = wait_calls(code)
                assert windows == launches(code) == waited, (rank, name, kind, windows, launches(code), waited)
                assert calls == count, (rank, name, kind, calls, count)
                checked[name, kind] = windows
    print(f"windows checked ({group}):", checked)
