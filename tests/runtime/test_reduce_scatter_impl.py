"""reduce_scatter_impl: auto. The claim it rests on (all-to-all plus a local sum is
bitwise equal to gloo's reduce-scatter on 2 ranks per shard group, and not on 3 or 4) is
checked on real gloo ranks; the choice per backend and world, and what the report and
``fsdp-overlap check`` say, on a fake process group."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from _fake import fake_world

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.cli import main
from fsdp_overlap_plugin.config.schema import OverlapConfigError
from fsdp_overlap_plugin.runtime.devices import GLOO_ALL_TO_ALL_BITWISE, reduce_scatter_choice
from fsdp_overlap_plugin.runtime.exchange import _LIVE, GROUP_PREFIX, build_receive_first_group, exchanges_run

pytestmark = pytest.mark.torch_sensitive  # CI runs its quick tests on both ends of its torch matrix (2.11, 2.15)

DTYPES = (torch.float32, torch.bfloat16)
CHUNKS = (1, 7, 64, 1000, 4099)


def _compare(rank: int, world: int) -> dict:
    """Per dtype: how many of 10 random gradient-like tensors give bitwise equal results
    through gloo's reduce_scatter_tensor and through all_to_all_single + sum over ranks
    (what passes/all_to_all.py emits: view [world, chunk] and sum(dim 0))."""
    out = {}
    for dtype in DTYPES:
        equal = 0
        for trial in range(10):
            chunk = CHUNKS[trial % len(CHUNKS)]
            g = torch.Generator().manual_seed(1000 * trial + rank)
            x = (torch.randn(world * chunk, generator=g) * 10.0 ** (trial % 4)).to(dtype)
            native = torch.empty(chunk, dtype=dtype)
            dist.reduce_scatter_tensor(native, x.clone())
            received = torch.empty_like(x)
            dist.all_to_all_single(received, x.clone(), [chunk] * world, [chunk] * world)
            equal += torch.equal(native, received.view(world, chunk).sum(0))
        out[str(dtype)] = equal
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_to_all_is_bitwise_equal_to_gloo_exactly_where_auto_uses_it(world):
    results = run_ranks(_compare, world=world)
    for rank, per_dtype in enumerate(results):
        for dtype, equal in per_dtype.items():
            if world in GLOO_ALL_TO_ALL_BITWISE:
                assert equal == 10, (world, rank, dtype, equal)
            else:
                # the ring adds in another order: some results differ in the last bits
                assert equal < 10, (world, rank, dtype, equal)
    bitwise = all(all(v == 10 for v in r.values()) for r in results)
    impl, _ = reduce_scatter_choice("auto", "gloo", world)
    assert (impl == "receive_first") == bitwise  # all-to-all plus a local sum, receives first


@pytest.mark.parametrize(
    ("requested", "backend", "size", "impl", "reason"),
    [
        ("auto", "gloo", 2, "receive_first", "bitwise equal on 2 ranks"),
        ("auto", "gloo", 3, "native", "equal only up to rounding"),
        ("auto", "gloo", 4, "native", "equal only up to rounding"),
        ("auto", "nccl", 2, "native", "already sends each rank only its chunk"),
        ("auto", "hccl", 8, "native", "already sends each rank only its chunk"),
        ("auto", "gloo", 1, "native", "nothing to scatter"),
        ("all_to_all", "gloo", 4, "all_to_all", "set in the config"),
        ("native", "gloo", 2, "native", "set in the config"),
    ],
)
def test_choice(requested, backend, size, impl, reason):
    chosen, why = reduce_scatter_choice(requested, backend, size)
    assert chosen == impl and reason in why


def test_compile_false_reduces_natively():
    assert reduce_scatter_choice("all_to_all", "gloo", 2, compiled=False)[0] == "native"


def _report(world: int, **config) -> dict:
    from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn

    with fake_world(world):
        torch.manual_seed(0)
        model = gpt_small()
        fo.parallelize(model, backend="aot_eager", **config)
        x, y = fixed_batches(1, world, 16, 256)[0]
        loss_fn(model(x), y).backward()
        return fo.schedule_report(model)


@pytest.mark.parametrize(
    ("world", "mesh", "impl"), [(2, None, "receive_first"), (4, None, "native"), (4, {"replicate": 2}, "receive_first")]
)
def test_parallelize_resolves_auto_per_shard_group(world, mesh, impl):
    report = _report(world, **({"mesh": mesh} if mesh else {}))
    assert report["reduce_scatter"]["requested"] == "auto" and report["reduce_scatter"]["impl"] == impl
    backward = report["backward"]
    assert ("all_to_all" in backward["passes"]) == (impl == "receive_first")
    assert backward["after"].get("reduce_scatter_as_all_to_all", 0) == (
        backward["after"]["reduce_scatter"] if impl == "receive_first" else 0
    )
    text = fo.format_report(report)
    assert f"gradient reduce-scatter: auto -> {impl} (" in text
    assert (" a2a" in text) == (impl == "receive_first")  # the reduce-scatter column says how they ran
    assert (len(report["reduce_scatter"]["groups"]) == 1) == (impl == "receive_first")


def test_check_says_what_auto_picks(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("reduce_scatter_impl: auto\n")
    for world, gloo in ((2, "receive_first"), (4, "native")):
        code = main(
            ["check", str(path), "--model", "fsdp_overlap_plugin.models.gpt:gpt_small", "--world", str(world), "--json"]
        )
        out = json.loads(capsys.readouterr().out)
        assert code == 0 and out["reduce_scatter"]["gloo"][0] == gloo and out["reduce_scatter"]["nccl"][0] == "native"
    main(["check", str(path), "--model", "fsdp_overlap_plugin.models.gpt:gpt_small", "--world", "2"])
    text = capsys.readouterr().out
    assert "reduce-scatter  reduce_scatter_impl: auto -> native on nccl / hccl; receive_first on gloo" in text


# --- receive_first: the all-to-alls on a group that posts every receive before any send


@pytest.mark.parametrize("backend", ["nccl", "hccl"])
def test_receive_first_is_an_error_off_gloo(backend):
    with pytest.raises(OverlapConfigError, match=rf"reduce_scatter_impl: receive_first .*{backend}.*auto, native"):
        reduce_scatter_choice("receive_first", backend, 2)
    assert reduce_scatter_choice("receive_first", "gloo", 4) == ("receive_first", "set in the config")


def _exchange(rank: int, world: int) -> dict:
    """The functional all-to-all (what the compiled graphs call) on a receive-first group
    and gloo's all_to_all_single on the same tensors, even and uneven splits."""
    name = build_receive_first_group(dist.group.WORLD)
    out = {"equal": [], "name": name}
    for trial, chunk in enumerate((1, 7, 1000)):
        g = torch.Generator().manual_seed(100 * trial + rank)
        x = torch.randn(world * chunk, 3, generator=g)
        ours = torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_to_all_single(x, [chunk] * world, [chunk] * world, name)
        )
        theirs = torch.empty_like(x)
        dist.all_to_all_single(theirs, x)
        out["equal"].append(torch.equal(ours, theirs))
    # uneven: rank r sends r + p + 1 rows to peer p
    send = [rank + p + 1 for p in range(world)]
    recv = [p + rank + 1 for p in range(world)]
    x = torch.arange(sum(send), dtype=torch.float32) + 1000 * rank
    ours = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_to_all_single(x, recv, send, name))
    theirs = torch.empty(sum(recv))
    dist.all_to_all_single(theirs, x, recv, send)
    out["equal"].append(torch.equal(ours, theirs))
    out["exchanges"] = exchanges_run(name)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_receive_first_all_to_all_equals_gloo_bitwise(world):
    for result in run_ranks(_exchange, world=world):
        assert result["equal"] == [True] * 4 and result["exchanges"] == 4
        assert result["name"].startswith(GROUP_PREFIX)


@pytest.mark.parametrize(("world", "mesh"), [(2, None), (4, {"replicate": 2})])
def test_receive_first_report(world, mesh):
    report = _report(world, reduce_scatter_impl="receive_first", **({"mesh": mesh} if mesh else {}))
    rs = report["reduce_scatter"]
    assert rs["impl"] == "receive_first" and rs["reason"] == "set in the config"
    (group,) = rs["groups"]
    assert group.startswith(GROUP_PREFIX)
    scattered = report["backward"]["after"]["reduce_scatter"]
    assert scattered > 0 and report["backward"]["after"]["reduce_scatter_as_all_to_all"] == scattered
    assert rs["exchanges"] == scattered  # one backward: each all-to-all ran on the group once
    text = fo.format_report(report)
    assert f"all-to-alls on {group}, every receive posted before any send: {scattered} run" in text


def test_receive_first_count_starts_at_parallelize():
    from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn

    with fake_world(2):
        counts = []
        for steps in (1, 2):  # a second model in the same process counts only its own
            torch.manual_seed(0)
            model = gpt_small()
            fo.parallelize(model, backend="aot_eager")
            for x, y in fixed_batches(steps, 2, 16, 256):
                loss_fn(model(x), y).backward()
            report = fo.schedule_report(model)
            counts.append(report["reduce_scatter"]["exchanges"] / report["backward"]["after"]["reduce_scatter"])
        assert counts == [1, 2]


def test_receive_first_group_is_made_once_per_shard_group():
    with fake_world(2):
        name = build_receive_first_group(dist.group.WORLD)
        first = _LIVE[name]
        assert build_receive_first_group(dist.group.WORLD) == name and _LIVE[name] is first
        assert first.inner is dist.group.WORLD
    with fake_world(2):  # a new world after destroy_process_group: the same name, a new group
        assert build_receive_first_group(dist.group.WORLD) == name
        assert _LIVE[name] is not first and _LIVE[name].inner is dist.group.WORLD
        assert torch._C._distributed_c10d._resolve_process_group(name) is _LIVE[name]


def test_check_says_receive_first_is_gloo_only(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("reduce_scatter_impl: receive_first\n")
    args = ["check", str(path), "--model", "fsdp_overlap_plugin.models.gpt:gpt_small", "--world", "2"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reduce_scatter"]["gloo"] == ["receive_first", "set in the config"]
    assert out["reduce_scatter"]["nccl"][0] == "error" and "nccl has no such mode" in out["reduce_scatter"]["nccl"][1]
    main(args)
    text = capsys.readouterr().out
    assert "reduce_scatter_impl: receive_first -> an error on nccl / hccl; receive_first on gloo" in text
    assert "hccl has no such mode. Valid on hccl: auto, native, all_to_all." in text
