"""_torch_compat: the core works without the inductor internals it uses, the inductor
slots keep passes installed before ours (with torch 2.11's one-pass slots too), and the
supported torch range comes from pyproject.toml alone."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from _fake import fake_world

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin import _torch_compat as compat
from fsdp_overlap_plugin import _version
from fsdp_overlap_plugin.models.gpt import gpt_small

pytestmark = [pytest.mark.torch_sensitive, pytest.mark.feature_probes]  # CI: on every torch of its matrix

ROOT = Path(__file__).resolve().parents[2]

# What "an inductor internal moved" looks like: the private modules and names the package
# uses, gone (the names torch 2.11 lacks, and more).
_WITHOUT_INTERNALS = """
import sys
import torch._inductor.custom_graph_pass as custom
for name in ("CustomGraphPass", "CustomInferenceAwareGraphPass", "get_custom_graph_passes"):
    if hasattr(custom, name):  # torch 2.11 has no CustomInferenceAwareGraphPass to delete
        delattr(custom, name)
for name in ("torch._inductor.fx_passes.bucketing", "torch._inductor.fx_passes.control_dependencies",
             "torch._inductor.compile_fx", "torch._inductor.runtime.cache_dir_utils"):
    sys.modules[name] = None  # import raises ImportError
"""


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_INTERNALS + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_inspect_and_check_work_without_the_inductor_internals():
    result = _python(
        """
        import fsdp_overlap_plugin
        from fsdp_overlap_plugin.cli import main
        spec = "fsdp_overlap_plugin.models.gpt:gpt_small"
        assert main(["inspect", spec]) == 0
        assert main(["check", "configs/plugin.yaml", "--model", spec]) in (0, 1)  # 1: --strict-only warnings
        print("CORE-OK")
        """
    )
    assert "CORE-OK" in result.stdout, result.stderr[-3000:]


def test_compiling_with_inductor_names_the_missing_feature_and_the_key():
    result = _python(
        """
        import torch
        from torch.testing._internal.distributed.fake_pg import FakeStore
        import torch.distributed as dist
        import fsdp_overlap_plugin as fo
        from fsdp_overlap_plugin.models.gpt import gpt_small
        from fsdp_overlap_plugin._torch_compat import TorchFeatureError
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        try:
            fo.parallelize(gpt_small(), backend="inductor")
        except TorchFeatureError as exc:  # at parallelize, before any graph is compiled
            print("ERROR:", exc)
        """
    )
    assert "ERROR:" in result.stdout, result.stderr[-3000:]
    message = re.search(r"ERROR: (.*)", result.stdout).group(1)
    assert "backend: inductor" in message and torch.__version__ in message and "aot_eager" in message


class _Recorded:
    def __init__(self, calls: list, name: str, uuid: str | None):
        self.calls, self.name, self._uuid = calls, name, uuid

    def __call__(self, graph):
        self.calls.append(self.name)


def _pass(calls: list, name: str, uuid: str | None = "u"):
    """A CustomGraphPass that records its calls (a plain function when uuid is None)."""
    if uuid is None:
        return lambda graph: calls.append(name)
    cls = type("P", (_Recorded, compat.custom_graph_pass_class()), {"uuid": lambda self: self._uuid})
    return cls(calls, name, uuid)


@pytest.mark.parametrize("one_pass_slots", [False, True], ids=["tuple-slots", "one-pass-slots"])
def test_chain_runs_installed_passes_first_and_combines_uuids(monkeypatch, one_pass_slots):
    if one_pass_slots:  # what torch 2.11 has: the slot holds one pass
        monkeypatch.setattr(compat, "_slot_takes_a_list", lambda: False)
    calls: list = []
    theirs, ours = _pass(calls, "theirs", "t"), _pass(calls, "ours", "o")
    slot = compat.chain_graph_passes(theirs, ours)
    if one_pass_slots or not compat._slot_takes_a_list():
        assert isinstance(slot, compat.custom_graph_pass_class())
        slot(None)
        assert calls == ["theirs", "ours"]
        uuid = slot.uuid()
        assert uuid and uuid != compat.chain_graph_passes(_pass(calls, "theirs", "t2"), ours).uuid()
        # a plain function cannot be hashed: no uuid, so inductor bypasses its cache, as for the function
        assert compat.chain_graph_passes(_pass(calls, "f", None), ours).uuid() is None
        # chaining again does not nest: the same flat list, plus the new pass
        assert compat.installed_graph_passes(compat.chain_graph_passes(slot, ours)) == (theirs, ours, ours)
    else:
        assert slot == (theirs, ours)
    assert compat.installed_graph_passes(None) == ()


def test_inductor_runs_a_pass_installed_before_ours_first_on_every_graph(monkeypatch):
    """The slot as torch_npu leaves it (one CustomGraphPass): on this torch's real inductor,
    theirs runs, then ours, on the forward and the backward."""
    from torch._inductor import config as inductor_config

    import fsdp_overlap_plugin.compile.backends as fo_compile

    calls: list = []
    theirs = _pass(calls, "theirs", "theirs-v1")
    original = fo_compile.run_passes

    def ours(gm, kind, state, **kwargs):
        calls.append(f"ours:{kind}")
        return original(gm, kind, state, **kwargs)

    monkeypatch.setattr(fo_compile, "run_passes", ours)
    # inductor's config's own patch: monkeypatch's undo would delete the config entry
    # (the config module's delattr), and every later test's compile would then fail
    with inductor_config.patch(post_grad_custom_post_pass=theirs), fake_world(2):
        model = gpt_small(n_layer=1, d_model=32)
        fo.parallelize(model, backend="inductor")
        model(torch.randint(0, 256, (2, 16))).sum().backward()
    assert calls == ["theirs", "ours:forward", "theirs", "ours:backward"]
    assert inductor_config.post_grad_custom_post_pass is None  # restored, not deleted


def test_supported_range_comes_from_pyproject_and_the_installed_metadata(monkeypatch):
    text = (ROOT / "pyproject.toml").read_text()
    low, high = (
        re.search(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"', text).groups()[:2],
        re.search(r'"torch>=\d+\.\d+,<(\d+)\.(\d+)"', text).groups(),
    )
    expected = (tuple(map(int, low)), tuple(map(int, high)))
    assert _version.supported_torch() == expected
    monkeypatch.setattr(_version, "_PYPROJECT", ROOT / "no-such-pyproject.toml")  # an installed wheel
    assert _version.supported_torch() == expected  # the same range, from the package metadata


@pytest.mark.parametrize(
    "version, warns", [("2.10.2", True), ("2.11.0+cu130", False), ("2.15.0", False), ("2.16.0", True)]
)
def test_a_torch_outside_the_range_warns_naming_it(monkeypatch, version, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _version.check_torch_version(version)
    messages = [str(w.message) for w in caught]
    assert bool(messages) == warns, messages
    if warns:
        assert _version.supported_range() in messages[0] and version in messages[0]


def test_symbolic_sizes_trace_through_a_tensor_parallel_linear_with_the_plugins_help():
    """docs/tensor-parallel.md's reproduction, which torch 2.13-2.15 alone cannot trace (AOT
    autograd recursed without end): inside ``symbols_keep_their_first_proxy`` it compiles
    once, symbolic, for three lengths, forward and backward. On every torch of the matrix the
    probe must find what that wraps, or tensor-parallel runs would compile each length."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    assert compat.symbolic_sizes_traceable_under_tensor_parallel()
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        counter = CompileCounterWithBackend("aot_eager")
        step = torch.compile(mlp, backend=counter, fullgraph=True, dynamic=True)
        with compat.symbols_keep_their_first_proxy():
            for length in (16, 12, 8):
                step(torch.randn(2, length, 8, requires_grad=True)).sum().backward()
        # a fake process group's collectives leave their outputs unwritten: shapes, not values
        shapes = [(p.to_local().shape, p.grad.to_local().shape) for p in mlp.parameters() if p.grad is not None]
        torch._dynamo.reset()
    assert counter.frame_count == 1
    assert len(shapes) == 4 and all(param == grad for param, grad in shapes), shapes
