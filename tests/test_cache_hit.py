"""An FX graph cache hit in a fresh process: the compiled code loads (our passes do not
run), and the schedule report still shows what they did, marked as from the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn
torch.manual_seed(0)
model = gpt_small(n_layer=2)
fo.parallelize(model, backend="inductor")
x, y = fixed_batches(1, 2, 16, 256)[0]
loss_fn(model(x), y).backward()
report = fo.schedule_report(model)
print("REPORT" + json.dumps({k: report[k] for k in ("forward", "backward", "reshard", "graphs")}))
"""


def _run(cache_dir: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("REPORT"))
    return json.loads(line[len("REPORT") :])


def test_report_survives_an_fx_graph_cache_hit(tmp_path):
    cold = _run(str(tmp_path))
    warm = _run(str(tmp_path))
    assert cold["graphs"] and not cold["forward"].get("from_cache")
    assert warm["graphs"] == []  # the passes did not run: inductor loaded compiled code
    for kind in ("forward", "backward"):
        assert warm[kind]["from_cache"] is True
        assert warm[kind]["after"] == cold[kind]["after"]
        assert warm[kind]["passes"].keys() == cold[kind]["passes"].keys()
    assert warm["reshard"]["from_cache"] is True
    assert warm["reshard"]["resharded"] == cold["reshard"]["resharded"] > 0
