"""A trained model out of a Lightning run, on 2 gloo ranks: examples/hf_lightning.py's
LightningModule (``self.model`` a tied transformers Llama, vocabulary 97), trained with
``Trainer(strategy=FSDPOverlapStrategy(...))``:

* in the run, ``fsdp_overlap_plugin.save_pretrained(self.model, out)`` in ``on_train_end``
  (the example's ``--export``) and ``self.model.save_pretrained(out)`` on every rank: plain
  ``from_pretrained``, in a process that never imports the plugin, gives the trained
  model's logits (fp32: bitwise here, within 1e-6 asked);
* after it, ``fsdp-overlap export`` of the sharded checkpoint (a DCP folder) and of the full
  one (``state_dict_type="full"``, Lightning FSDP's spelling: one ``torch.save`` file) gives
  the same files, the LightningModule's ``model.`` prefix found by the model's names.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import _hf
import pytest
import torch
import torch._dynamo
from _dist import run_ranks
from _export import assert_same_tensors, folder_tensors, load_without_plugin
from _lightning import trainer
from torch.utils.data import DataLoader, TensorDataset

from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
SAMPLES, PER_RANK = 16, 2


def _example():
    sys.path.insert(0, str(ROOT / "examples"))
    import hf_lightning

    return hf_lightning


def _fit(root: str, data: TensorDataset, export: str | None = None, **strategy):
    torch._dynamo.reset()
    lit = _example().CausalLMModule(_hf.config("llama"), lr=3e-3, seed=0, export=export)
    tr = trainer(root, max_epochs=1, strategy=FSDPOverlapStrategy(backend="aot_eager", **strategy), precision="32-true")
    tr.fit(lit, DataLoader(data, batch_size=PER_RANK))
    return lit, tr


def _runs(rank: int, world: int, root: str) -> dict:
    data = TensorDataset(_hf.batches(1, SAMPLES)[0])
    lit, tr = _fit(f"{root}/a", data, export=f"{root}/on_train_end")
    tr.save_checkpoint(f"{root}/sharded.ckpt")  # a DCP folder (the default)
    lit.model.save_pretrained(f"{root}/model_save_pretrained")  # transformers' method, every rank
    probe = torch.arange(32).reshape(2, 16) % _hf.VOCAB
    with torch.no_grad():
        logits = lit.model(input_ids=probe).logits
    params = {k: v.full_tensor() for k, v in lit.model.state_dict().items()}

    full_lit, full_tr = _fit(f"{root}/b", data, state_dict_type="full")
    full_tr.save_checkpoint(f"{root}/full.ckpt")  # one file, written by rank 0
    full_params = {k: v.full_tensor() for k, v in full_lit.model.state_dict().items()}
    if rank == 0:
        torch.save({"probe": probe, "logits": logits, "params": params}, f"{root}/reference.pt")
    return {"params": params, "full_params": full_params, "sharded_dist": full_tr.strategy._save_distributed_checkpoint}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("export_lightning")
    results = run_ranks(_runs, str(root), timeout=900)
    names = ("on_train_end", "model_save_pretrained")
    loaded = load_without_plugin({name: (root / name, root / "reference.pt") for name in names}, root)
    return {"root": root, "ranks": results, "loaded": loaded}


def test_saved_in_the_run_loads_with_plain_from_pretrained(run):
    loaded = run["loaded"]
    assert loaded["plugin imported"] is False
    for name in ("on_train_end", "model_save_pretrained"):
        assert loaded[name]["same_weights"], (name, loaded[name])  # the head's trained values included
        assert loaded[name]["head_is_embedding"] and loaded[name]["head_shares_data"], (name, loaded[name])
        assert _hf.head_storage_problems(run["root"] / name, "llama") == []  # no lm_head.weight in the files
        assert loaded[name]["logits"] <= 1e-6, (name, loaded[name])
    assert_same_tensors(
        folder_tensors(run["root"] / "on_train_end"), folder_tensors(run["root"] / "model_save_pretrained")
    )
    assert sorted(p.name for p in (run["root"] / "on_train_end").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


def test_state_dict_type_full_writes_one_file_of_full_tensors(run):
    root = run["root"]
    assert run["ranks"][0]["sharded_dist"] is False
    assert (root / "full.ckpt").is_file() and (root / "sharded.ckpt").is_dir()
    state = torch.load(root / "full.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    params = run["ranks"][0]["full_params"]
    assert {k.removeprefix("model."): tuple(v.shape) for k, v in state.items()} == {
        k: tuple(v.shape) for k, v in params.items()
    }
    for key, value in params.items():
        assert torch.equal(state[f"model.{key}"], value), key


@pytest.mark.parametrize("checkpoint", ["sharded.ckpt", "full.ckpt"])
def test_export_cli_turns_lightnings_checkpoints_into_the_in_run_files(run, checkpoint, tmp_path):
    root = run["root"]
    cli = ROOT / ".venv" / "bin" / "fsdp-overlap"
    command = [str(cli) if cli.exists() else "fsdp-overlap", "export", str(root / checkpoint), str(tmp_path / "out")]
    proc = subprocess.run(
        [*command, "--model", f"hf:{root / 'on_train_end'}"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "its state dict at 'state_dict.model.'" in proc.stdout, proc.stdout
    kind = "Lightning sharded checkpoint" if checkpoint == "sharded.ckpt" else "torch.save file"
    assert f"read   {kind}" in proc.stdout
    exported = folder_tensors(tmp_path / "out")
    assert _hf.head_storage_problems(tmp_path / "out", "llama") == []
    if checkpoint == "sharded.ckpt":  # the same run: the same files as its in-run export
        assert_same_tensors(exported, folder_tensors(root / "on_train_end"))
    else:  # the second run, with state_dict_type="full": its own trained weights
        params = run["ranks"][0]["full_params"]
        assert_same_tensors(exported, {k: v for k, v in params.items() if k != "lm_head.weight"})
    assert (tmp_path / "out" / "config.json").read_text() == (root / "on_train_end" / "config.json").read_text()
