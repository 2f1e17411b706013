"""Weights out, in one process (no process group): ``fsdp_overlap_plugin.save_pretrained``
writes what transformers' own ``save_pretrained`` writes, file for file and bit for bit, for
every family of tests/_hf.py (tied, untied, a Mixtral whose fused experts go back to one
tensor per expert, a GPT-NeoX whose ``lm_head`` goes back to ``embed_out``); the
safetensors files it streams are the safetensors library's; and ``fsdp-overlap export``
reads each checkpoint format back into the same files, with memory near one tensor.

The 2-rank runs (sharded models, Accelerate's and Lightning's recipes, other world sizes)
are in test_export_accelerate.py, test_export_lightning.py and test_export_interop.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import _hf
import pytest
import torch
import torch.nn as nn
from _cli import run, run_json
from _export import assert_same_tensors, folder_tensors
from safetensors import safe_open
from safetensors.torch import load_file

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.config.schema import OverlapConfigError
from fsdp_overlap_plugin.shard import export

pytestmark = pytest.mark.torch_sensitive  # CI runs its quick tests on both ends of its torch matrix (2.11, 2.15)

T = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def weight_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("model"))


# ---------------------------------------------------------------- save_pretrained
@pytest.mark.parametrize("family", _hf.FAMILIES)
def test_save_pretrained_writes_what_transformers_writes(tmp_path, family):
    model = _hf.build(family, seed=3)
    model.save_pretrained(tmp_path / "transformers")
    summary = fo.save_pretrained(model, tmp_path / "ours")
    assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "transformers"))
    assert_same_tensors(folder_tensors(tmp_path / "ours"), folder_tensors(tmp_path / "transformers"))
    for name in ("config.json", "generation_config.json"):
        ours, theirs = (json.loads((tmp_path / d / name).read_text()) for d in ("ours", "transformers"))
        assert ours == theirs, name
    assert summary["dropped"] == (["lm_head.weight"] if _hf.TIED[family] else [])
    # what the files hold, read from them: transformers' own folder keeps the rule, ours too
    assert _hf.head_storage_problems(tmp_path / "transformers", family) == []
    assert _hf.head_storage_problems(tmp_path / "ours", family) == []
    if family == "mixtral":  # 4 experts' fused gate_up_proj and down_proj -> w1, w2, w3 per expert
        assert summary["tensors"] == len(model.state_dict()) + 2 * (3 * 4 - 2)
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in folder_tensors(tmp_path / "ours")
    reloaded = T.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    ids = _hf.batches(1, 2)[0]
    assert torch.equal(reloaded(ids).logits, model(ids).logits)
    head, embedding = reloaded.get_output_embeddings().weight, reloaded.get_input_embeddings().weight
    assert (head is embedding) is _hf.TIED[family]
    assert torch.equal(head, model.get_output_embeddings().weight)  # the trained values


def test_past_max_shard_size_the_weights_are_split_with_an_index(tmp_path):
    model = _hf.build("llama", seed=1)
    summary = fo.save_pretrained(model, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    assert weight_files(tmp_path) == sorted([*files, "model.safetensors.index.json"])
    assert summary["files"][: len(files)] == files
    assert (
        index["metadata"]["total_size"] == summary["bytes"] == sum(t.nbytes for t in folder_tensors(tmp_path).values())
    )
    assert index["metadata"]["total_parameters"] == sum(p.numel() for p in model.parameters())
    for name in files:  # every file at most 40 KB unless one tensor alone is larger
        tensors = load_file(tmp_path / name)
        assert sum(t.nbytes for t in tensors.values()) <= 40_000 or len(tensors) == 1
    reloaded = T.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = _hf.batches(1, 2)[0]
    assert torch.equal(reloaded(ids).logits, model(ids).logits)
    # saved again in one file: the shards of the first save are gone, as transformers does
    fo.save_pretrained(model, tmp_path)
    assert weight_files(tmp_path) == ["model.safetensors"]


def test_dtype_casts_floating_point_tensors_and_the_config_says_so(tmp_path):
    model = _hf.build("qwen2")
    model.register_buffer("steps", torch.tensor([3, 4]), persistent=True)  # an integer buffer stays integer
    fo.save_pretrained(model, tmp_path, dtype="bf16")
    tensors = folder_tensors(tmp_path)
    assert tensors["steps"].dtype == torch.int64 and tensors["steps"].tolist() == [3, 4]
    assert {t.dtype for k, t in tensors.items() if k != "steps"} == {torch.bfloat16}
    assert torch.equal(tensors["lm_head.weight"], model.lm_head.weight.detach().to(torch.bfloat16))
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


class Mixed(nn.Module):
    """Not a transformers model: tied parameters, buffers of several dtypes, a 0-dim one."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 3)
        self.head = nn.Linear(3, 7, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("fp16", torch.arange(5, dtype=torch.float16))
        self.register_buffer("bf16", torch.randn(3, dtype=torch.bfloat16))
        self.register_buffer("flags", torch.tensor([True, False, True]))
        self.register_buffer("count", torch.tensor(11, dtype=torch.int64))
        self.register_buffer("empty", torch.zeros(0, 4))
        self.register_buffer("scratch", torch.ones(2), persistent=False)


def test_a_plain_module_round_trips_through_load_state_dict(tmp_path):
    torch.manual_seed(0)
    model = Mixed()
    summary = fo.save_pretrained(model, tmp_path)
    assert weight_files(tmp_path) == ["model.safetensors"]  # and no config: not a transformers model
    assert not (tmp_path / "config.json").exists() and summary["dropped"] == []
    tensors = load_file(tmp_path / "model.safetensors")
    # both names of the tied weight, each its own copy, so load_state_dict takes the file as it is
    assert set(tensors) == set(model.state_dict())
    copy = Mixed()
    copy.load_state_dict(tensors, strict=True)
    assert_same_tensors(dict(copy.state_dict()), {k: v.detach() for k, v in model.state_dict().items()})
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    # every tensor starts aligned to its element size (larger elements first)
    header_len = int.from_bytes((tmp_path / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((tmp_path / "model.safetensors").read_bytes()[8 : 8 + header_len])
    assert header_len % 8 == 0
    for name, entry in header.items():
        if name != "__metadata__":
            assert entry["data_offsets"][0] % tensors[name].element_size() == 0, name


def test_save_pretrained_refuses_what_it_cannot_write(tmp_path):
    model = Mixed()
    model.register_buffer("complex", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(OverlapConfigError, match="complex64, which safetensors cannot store"):
        fo.save_pretrained(model, tmp_path)
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())  # nothing half-written left
    with pytest.raises(OverlapConfigError, match="dtype: unknown dtype|dtype"):
        fo.save_pretrained(Mixed(), tmp_path, dtype="bfloat17")


def test_a_lightning_style_wrapper_saves_its_transformers_model(tmp_path):
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = _hf.build("llama", seed=2)

    wrapper = Wrapper()
    summary = fo.save_pretrained(wrapper, tmp_path)
    assert summary["notes"][0].startswith("saved model (LlamaForCausalLM)")
    assert (tmp_path / "config.json").exists()
    assert_same_tensors(
        folder_tensors(tmp_path), {k: v for k, v in wrapper.model.state_dict().items() if k != "lm_head.weight"}
    )


# ------------------------------------------------------- the head check reads the files
def _add_entries(folder: Path, file: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` into ``folder/file`` (beside what it holds) and into the index."""
    from safetensors.torch import save_file

    path = folder / file
    held = load_file(path) if path.exists() else {}
    save_file({**held, **tensors}, path, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(tensors, file))
        index.write_text(json.dumps(data))


def test_a_tied_head_stored_in_the_files_fails_the_head_check(tmp_path):
    """The mutation: a tied Llama's exported folder with ``lm_head.weight`` written into its
    files. config.json still says tied and from_pretrained still ties the head (what the old
    check read); the check reads the files and names the file and the entry."""
    import shutil

    model = _hf.build("llama", seed=6)
    fo.save_pretrained(model, tmp_path / "one")
    fo.save_pretrained(model, tmp_path / "split", max_shard_size="40KB")
    assert _hf.head_storage_problems(tmp_path / "one", "llama") == []
    assert _hf.head_storage_problems(tmp_path / "split", "llama") == []
    head = {"lm_head.weight": model.lm_head.weight.detach().clone()}

    one = shutil.copytree(tmp_path / "one", tmp_path / "one_with_head")
    _add_entries(one, "model.safetensors", head)
    assert _hf.head_storage_problems(one, "llama") == [
        f"{one}/model.safetensors holds lm_head.weight, but the head is tied to model.embed_tokens.weight: "
        "the files of a tied model leave the head out"
    ]
    assert json.loads((one / "config.json").read_text())["tie_word_embeddings"] is True
    loaded = T.AutoModelForCausalLM.from_pretrained(one)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # config.json alone cannot tell

    split = shutil.copytree(tmp_path / "split", tmp_path / "split_with_head")
    _add_entries(split, "model-extra.safetensors", head)
    (problem,) = _hf.head_storage_problems(split, "llama")
    assert problem.startswith(f"{split}/model-extra.safetensors holds lm_head.weight"), problem
    # an index naming an entry no file holds is a broken folder, not a tied one
    index = split / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(AssertionError, match=r"index.json disagrees with the files' headers on \['lm_head.weight'\]"):
        _hf.stored_entries(split)


def test_an_untied_head_missing_from_the_files_fails_the_head_check(tmp_path):
    from safetensors.torch import save_file

    model = _hf.build("qwen2", seed=6)
    fo.save_pretrained(model, tmp_path)
    assert _hf.head_storage_problems(tmp_path, "qwen2") == []
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert _hf.head_storage_problems(tmp_path, "qwen2") == [
        f"{tmp_path}: no file holds lm_head.weight (model.safetensors), and the untied head must be stored"
    ]
    # and a tied model read as untied, or the other way round: the check follows what it is told
    assert _hf.head_storage_problems(tmp_path, "qwen2", tied=True) == []
    fo.save_pretrained(_hf.build("llama"), tmp_path / "llama")
    assert _hf.head_storage_problems(tmp_path / "llama", "llama", tied=False) == [
        f"{tmp_path / 'llama'}: no file holds lm_head.weight (model.safetensors), and the untied head must be stored"
    ]


# ------------------------------------------------------------------ fsdp-overlap export
def _checkpoints(tmp_path: Path, model: nn.Module) -> dict[str, Path]:
    """The same weights in each checkpoint layout the export reads, written in one process
    (the 2-rank tests write them from real runs)."""
    import torch.distributed.checkpoint as dcp

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {}
    out["dcp"] = tmp_path / "dcp"  # dcp.save(model.state_dict()): torch's fully_shard users
    dcp.save(state, checkpoint_id=out["dcp"])
    out["step"] = tmp_path / "run"  # fsdp_overlap_plugin.shard.checkpoint.save
    fo_checkpoint = __import__("fsdp_overlap_plugin.shard.checkpoint", fromlist=["save"])
    fo_checkpoint.save(out["step"], model, torch.optim.SGD(model.parameters(), lr=0.1), step=3)
    lightning = {f"model.{k}": v for k, v in state.items()}  # a LightningModule's self.model
    out["lightning_dir"] = tmp_path / "lightning.ckpt"
    dcp.save({"state_dict": lightning, "optimizer_0": {"x": torch.zeros(2)}}, checkpoint_id=out["lightning_dir"])
    torch.save({"epoch": 1}, out["lightning_dir"] / "meta.pt")
    out["lightning_file"] = tmp_path / "full.ckpt"
    torch.save({"state_dict": lightning, "epoch": 1, "global_step": 4}, out["lightning_file"])
    out["accelerate_fsdp"] = tmp_path / "accelerate_gpu"  # save_state on GPUs: pytorch_model_fsdp_0/
    dcp.save({"model": state}, checkpoint_id=out["accelerate_fsdp"] / "pytorch_model_fsdp_0")
    out["accelerate_cpu"] = tmp_path / "accelerate_cpu"  # save_state on a CPU launch: model.safetensors
    out["accelerate_cpu"].mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, out["accelerate_cpu"] / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("checkpoints")
    untie = _hf.build("llama", seed=4)
    untie.model.embed_tokens.weight = nn.Parameter(untie.model.embed_tokens.weight.detach().clone())
    model = _hf.build("llama", seed=4)  # tied: the checkpoints hold lm_head.weight as well
    config = tmp / "config"
    model.config.save_pretrained(config)
    fo.save_pretrained(model, tmp / "reference")
    return {"paths": _checkpoints(tmp, model), "config": config, "reference": tmp / "reference", "model": model}


LAYOUTS = ["dcp", "step", "lightning_dir", "lightning_file", "accelerate_fsdp", "accelerate_cpu"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_reads_every_layout_into_the_in_run_files(capsys, tmp_path, checkpoints, layout):
    source = checkpoints["paths"][layout]
    code, out = run_json(capsys, "export", str(source), str(tmp_path / "out"), "--model", f"hf:{checkpoints['config']}")
    assert code == 0, out
    assert out["prefix"] == {"lightning_dir": "state_dict.model.", "lightning_file": "state_dict.model."}.get(
        layout, "model." if layout in ("step", "accelerate_fsdp") else ""
    )
    assert out["dropped"] == ["lm_head.weight"] and out["left_out"] == []
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.listdir(checkpoints["reference"]))
    assert_same_tensors(folder_tensors(tmp_path / "out"), folder_tensors(checkpoints["reference"]))
    assert _hf.head_storage_problems(tmp_path / "out", "llama") == []
    assert (tmp_path / "out" / "config.json").read_text() == (checkpoints["reference"] / "config.json").read_text()


def test_export_without_a_model_writes_the_checkpoints_names(capsys, tmp_path, checkpoints):
    code, text, _ = run(capsys, "export", str(checkpoints["paths"]["step"]), str(tmp_path / "out"), "--dtype", "bf16")
    assert code == 0
    assert "names  under 'model.'" in text and "pass --model hf:path/to/config.json" in text
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    expected = checkpoints["model"].state_dict()
    assert set(tensors) == set(expected)  # lm_head.weight too: nothing says it is tied
    for key, value in expected.items():
        assert torch.equal(tensors[key], value.detach().to(torch.bfloat16)), key
    assert not (tmp_path / "out" / "config.json").exists()


def test_export_names_what_it_cannot_read(capsys, tmp_path, checkpoints):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("")
    code, _, err = run(capsys, "export", str(tmp_path / "empty"), str(tmp_path / "out"))
    assert code == 2 and "not a checkpoint this tool reads (it holds ['notes.txt'])" in err
    code, _, err = run(capsys, "export", str(tmp_path / "missing"), str(tmp_path / "out"))
    assert code == 2 and "no checkpoint at" in err
    # a checkpoint of another model: the missing names and where it looked
    qwen = tmp_path / "qwen"
    _hf.config("qwen2").save_pretrained(qwen)
    code, _, err = run(
        capsys, "export", str(checkpoints["paths"]["step"]), str(tmp_path / "out"), "--model", f"hf:{qwen}"
    )
    assert code == 2 and "are not in the checkpoint" in err and "--prefix" in err, err
    # the same model with another width: the shapes named
    wide = tmp_path / "wide"
    _hf.config("llama", intermediate_size=96).save_pretrained(wide)
    code, _, err = run(
        capsys, "export", str(checkpoints["paths"]["step"]), str(tmp_path / "out"), "--model", f"hf:{wide}"
    )
    assert code == 2 and "[64, 32] in the checkpoint but" in err and "is [96, 32] in the model" in err, err
    code, _, err = run(
        capsys, "export", str(checkpoints["paths"]["step"]), str(tmp_path / "out"), "--prefix", "nothing."
    )
    assert code == 2 and "no tensor under the prefix 'nothing.'" in err
    code, _, err = run(capsys, "export", str(checkpoints["paths"]["step"]), str(tmp_path / "out"), "--dtype", "fp8")
    assert code == 2 and "--dtype" in err


_PEAK = """
import sys
from fsdp_overlap_plugin.cli import main
import torch.distributed.checkpoint, safetensors.torch  # what the export imports, before the baseline
import fsdp_overlap_plugin.cli.export  # main() imports a command's module when it runs it
def status(field):  # MiB
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) / 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the kernel resets this process's peak resident memory (VmHWM) to what it holds now
base = status("VmRSS")
code = main(["export", sys.argv[1], sys.argv[2]])
print(base, status("VmHWM"), code)
"""


def test_export_streams_so_its_memory_stays_near_one_tensor(tmp_path):
    """48 tensors of 4 MiB (192 MiB) on disk in a distributed checkpoint: the export's peak
    resident memory grows by a few tensors (15-30 MiB measured, whatever the tensor count:
    DCP reads a tensor's bytes, unpickles them, and copies them into the one asked for),
    never by the checkpoint."""
    import torch.distributed.checkpoint as dcp

    state = {f"layers.{i}.weight": torch.full((1024, 1024), float(i)) for i in range(48)}
    dcp.save({"model": state}, checkpoint_id=tmp_path / "step_00000001")
    del state
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PEAK), str(tmp_path / "step_00000001"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    base, peak, code = proc.stdout.split()[-3:]
    growth = float(peak) - float(base)
    assert code == "0" and growth < 12 * 4, (base, peak)  # MiB: a quarter of the checkpoint at most
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert len(tensors) == 48 and all(torch.all(tensors[f"layers.{i}.weight"] == i) for i in range(48))


def test_the_memory_benchmark_runs_and_checks_what_it_exported(tmp_path):
    """benchmarks/export_memory.py on a small checkpoint (1 layer): it measures the child's
    own peak and checks every exported tensor against the checkpoint."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "export_memory.py"), "--layers", "1", "--vocab", "512"]
        + ["--dir", str(tmp_path / "bench"), "--json", str(tmp_path / "result.json")],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["checked_tensors"] == result["tensors"] == 12  # embed, 9 per layer, norm, head
    assert 100e6 < result["export_peak_rss_bytes"] < 2e9  # an interpreter with torch, not a stale number


# ---------------------------------------------------------- Lightning's spelling
def test_state_dict_type_is_lightnings_spelling_of_save_distributed_checkpoint():
    from fsdp_overlap_plugin.lightning._common import distributed_checkpoint

    assert distributed_checkpoint(None, None) is True
    assert distributed_checkpoint(None, "full") is False and distributed_checkpoint(None, "sharded") is True
    assert distributed_checkpoint(False, None) is False and distributed_checkpoint(False, "full") is False
    with pytest.raises(OverlapConfigError, match="contradicts save_distributed_checkpoint=True"):
        distributed_checkpoint(True, "full")
    with pytest.raises(OverlapConfigError, match="Did you mean 'full'"):
        distributed_checkpoint(None, "ful")


@pytest.mark.parametrize("strategy", ["FSDPOverlapStrategy", "FSDPOverlapFabricStrategy"])
def test_both_strategies_take_state_dict_type(strategy):
    import fsdp_overlap_plugin.lightning as lightning

    cls = getattr(lightning, strategy)
    assert cls(state_dict_type="full")._save_distributed_checkpoint is False
    assert cls()._save_distributed_checkpoint is True
    with pytest.raises(OverlapConfigError, match="contradicts"):
        cls(state_dict_type="sharded", save_distributed_checkpoint=False)


def test_install_save_pretrained_keeps_transformers_own_for_full_state_dicts(tmp_path, monkeypatch):
    """The method parallelize() gives a transformers model: with full tensors in
    ``state_dict`` (what accelerator.get_state_dict returns) it is transformers' own."""
    model = _hf.build("gpt2")
    export.install_save_pretrained(model)
    assert "save_pretrained" in vars(model)
    calls = []
    library = type(model).save_pretrained
    monkeypatch.setattr(type(model), "save_pretrained", lambda self, *a, **k: calls.append(k) or library(self, *a, **k))
    model.save_pretrained(tmp_path / "a", state_dict=model.state_dict(), save_function=torch.save)
    assert len(calls) == 1 and (tmp_path / "a" / "model.safetensors").exists()
    model.save_pretrained(tmp_path / "b")  # no state dict: the streaming export (no call to the library's)
    assert len(calls) == 1
    assert_same_tensors(folder_tensors(tmp_path / "a"), folder_tensors(tmp_path / "b"))
    with pytest.raises(OverlapConfigError, match="push_to_hub=True.*upload_folder"):
        model.save_pretrained(tmp_path / "c", push_to_hub=True)
