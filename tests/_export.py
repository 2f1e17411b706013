"""What the export tests share (tests/shard/test_export.py and the framework export tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import load_file

# In a fresh interpreter that imports transformers and never the plugin: each folder loaded
# with plain from_pretrained, its logits on the reference's probe and its weights compared
# with the trained model's (reference.pt: probe, logits, full params, the head included),
# and whether the loaded head is the embedding's tensor. ``tie_word_embeddings`` in
# config.json makes from_pretrained tie the head whatever the files hold, so that alone says
# nothing about the export: check the files with ``_hf.head_storage_problems`` as well.
_LOAD_PLAIN = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
out = {}
for name, (folder, reference) in json.loads(sys.argv[1]).items():
    ref = torch.load(reference)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        logits = model(input_ids=ref["probe"]).logits
    state = model.state_dict()
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    out[name] = {
        "logits": (logits.float() - ref["logits"].float()).abs().max().item(),
        "same_weights": all(torch.equal(state[k], v) for k, v in ref["params"].items()),
        "dtypes": sorted({str(v.dtype) for v in state.values()}),
        # the loaded head: one tensor with the embedding (tied) or its own; what the files
        # hold is read from them by _hf.head_storage_problems, in the test's own process
        "head_is_embedding": head is embedding,
        "head_shares_data": head.data_ptr() == embedding.data_ptr(),
    }
out["plugin imported"] = "fsdp_overlap_plugin" in sys.modules
print(json.dumps(out))
"""


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a save_pretrained folder (one file, or the files of its index)."""
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(folder / name))
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def load_without_plugin(folders: dict[str, tuple[Path, Path]], cwd: Path) -> dict:
    """``{name: (save_pretrained folder, reference.pt)}`` -> what ``_LOAD_PLAIN`` found, per
    name, plus ``"plugin imported"``; run with the repository off ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    arg = json.dumps({name: [str(f), str(r)] for name, (f, r) in folders.items()})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_LOAD_PLAIN), arg],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])
