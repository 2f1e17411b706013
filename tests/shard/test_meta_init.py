"""Meta-device initialisation and sharded checkpoint loading, against transformers' own code.

In one process (quick): ``materialize`` on unsharded meta models of every family of
tests/_hf.py gives the buffers of a normal build exactly (rotary ``inv_freq``), norms of
ones and embeddings of ``initializer_range``; a tensor nothing initialises is an error
naming it (or, with ``on_uninitialized: warn``, a warning and zeros); a partial
initialisation is caught by the NaN check; ``load_pretrained`` refuses what it cannot do,
naming keys.

On 2 gloo ranks (slow): the issue's case (a meta-built ``LlamaForCausalLM``, sharded,
materialized: 0.1 gave it garbage ``inv_freq`` and a NaN first loss) for Llama, GPT-2 and
Qwen2; and a ``save_pretrained`` checkpoint (several safetensors files) loaded into a
meta-built sharded model through each entry point (core ``parallelize`` + ``materialize``,
Lightning ``configure_model`` via examples/hf_lightning.py, Fabric
``init_module(empty_init=True)``, Accelerate ``prepare``): losses equal
``from_pretrained`` trained in one process.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import _hf
import pytest
import torch
import torch.nn as nn
from _dist import run_ranks
from _train import local_slice

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin import OverlapConfigError, UninitializedWarning

pytestmark = pytest.mark.torch_sensitive  # CI runs its quick tests on both ends of its torch matrix (2.11, 2.15)

ROOT = Path(__file__).resolve().parents[2]
LOAD_FAMILIES = ("llama", "gpt2", "qwen2")  # tied + RMSNorm, Conv1D + learned positions, untied + biases
STEPS = 3
LR = 1e-3


def _meta(family: str, **overrides) -> nn.Module:
    import transformers as T

    with torch.device("meta"):
        return T.AutoModelForCausalLM.from_config(_hf.config(family, **overrides))


def _norm_weights(model: nn.Module) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if ("norm" in n.lower() or ".ln_" in n) and n.endswith("weight")]


# ----------------------------------------------------------------- one process
@pytest.mark.parametrize("family", _hf.FAMILIES)
def test_materialize_initialises_a_transformers_model_as_transformers_does(family):
    normal = _hf.build(family)
    model = _meta(family)
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    torch.manual_seed(0)
    fo.materialize(model, "cpu")
    want, got = dict(normal.named_buffers()), dict(model.named_buffers())
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name  # inv_freq recomputed exactly
    norms = _norm_weights(model)
    assert norms and all(bool((w == 1).all()) for w in norms)
    std = model.config.initializer_range
    embedding = model.get_input_embeddings().weight
    assert math.isclose(embedding.std().item(), std, rel_tol=0.1), embedding.std()
    ids = _hf.batches(1, 4)[0]
    assert math.isfinite(_hf.loss(model, ids).item())


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # tied, untied
def test_the_padding_row_is_zero_as_in_a_normal_build(family):
    """transformers initialises, then ties: the embedding's zero padding row survives a
    normal build of a tied model; initialising the already-tied tensor would overwrite it
    with lm_head's draw."""
    torch.manual_seed(0)
    import transformers as T

    normal = T.AutoModelForCausalLM.from_config(_hf.config(family, pad_token_id=1))
    assert torch.equal(normal.get_input_embeddings().weight[1], torch.zeros(32))
    model = _meta(family, pad_token_id=1)
    fo.materialize(model, "cpu")
    embedding = model.get_input_embeddings().weight
    assert torch.equal(embedding[1], torch.zeros(32)) and embedding[2].abs().sum() > 0
    assert (model.get_output_embeddings().weight is embedding) == (family == "llama")


class _Bare(nn.Module):
    """A parameter and a buffer that nothing initialises (no reset_parameters())."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(4))
        self.register_buffer("table", torch.arange(4.0))  # computed in __init__: lost on meta

    def forward(self, x):
        return x * self.scale + self.table


def test_a_tensor_nothing_initialises_is_an_error_naming_it():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Bare())
    with pytest.raises(OverlapConfigError, match=r"1\.scale \(_Bare, parameter\), 1\.table \(_Bare, buffer\)"):
        fo.materialize(model, "cpu")


def test_on_uninitialized_warn_sets_zero_and_names_them():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Bare())
    with pytest.warns(UninitializedWarning, match=r"1\.scale .* 1\.table"):
        fo.materialize(model, "cpu", on_uninitialized="warn")
    assert torch.equal(model[1].scale.detach(), torch.zeros(4)) and torch.equal(model[1].table, torch.zeros(4))
    assert model[0].weight.abs().sum() > 0  # the Linear was initialised
    with pytest.raises(OverlapConfigError, match="on_uninitialized: unknown value 'ignore'"):
        fo.materialize(model, "cpu", on_uninitialized="ignore")
    with pytest.raises(OverlapConfigError, match="on_uninitialized: unknown value 'quiet'; valid: error, warn"):
        fo.OverlapConfig(on_uninitialized="quiet")


def test_a_partial_initialisation_is_caught_by_the_nan_check():
    class Half(nn.Linear):
        def reset_parameters(self):
            with torch.no_grad():
                self.weight[:2].normal_()  # the other rows are never written
                self.bias.zero_()

    with torch.device("meta"):
        model = nn.Sequential(Half(4, 4))
    with pytest.raises(OverlapConfigError, match=r"NaN or inf after initialisation in 0\.weight"):
        fo.materialize(model, "cpu")


def test_real_buffers_keep_their_values():
    """Accelerate's init_empty_weights() keeps buffers on a real device (include_buffers=False):
    materialize allocates only what is on meta."""
    import transformers as T
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = T.AutoModelForCausalLM.from_config(_hf.config("llama"))
    assert model.model.embed_tokens.weight.is_meta and not model.model.rotary_emb.inv_freq.is_meta
    before = model.model.rotary_emb.inv_freq.clone()
    fo.materialize(model, "cpu")
    assert torch.equal(model.model.rotary_emb.inv_freq, before)


def _save(model: nn.Module, folder: Path, shard: str = "20KB") -> Path:
    model.save_pretrained(folder, max_shard_size=shard)
    return folder


def test_load_pretrained_into_an_unsharded_meta_model_equals_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = _save(_hf.build("neox", seed=7), tmp_path / "neox")  # embed_out.weight: renamed on load
    assert (folder / "model.safetensors.index.json").is_file()
    model = _meta("neox")
    fo.materialize(model, "cpu")
    info = fo.load_pretrained(model, folder)
    assert info["files"] > 1 and info["missing"] == [] and info["unexpected"] == []
    assert "embed_out.weight" in info["loaded"]
    want = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).state_dict()
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_load_pretrained_names_what_it_cannot_load(tmp_path):
    folder = _save(_hf.build("llama"), tmp_path / "llama", shard="10GB")
    other = _meta("llama", num_hidden_layers=3)
    fo.materialize(other, "cpu")
    with pytest.raises(OverlapConfigError, match=r"no tensor for model\.layers\.2\..*strict=False"):
        fo.load_pretrained(other, folder)
    info = fo.load_pretrained(other, folder, strict=False)
    assert any(name.startswith("model.layers.2.") for name in info["missing"]) and info["unexpected"] == []
    wide = _meta("llama", hidden_size=64)
    fo.materialize(wide, "cpu")
    with pytest.raises(OverlapConfigError, match=r"'model.embed_tokens.weight' has shape \[97, 32\].*\[97, 64\]"):
        fo.load_pretrained(wide, folder)
    mixtral = _meta("mixtral")
    fo.materialize(mixtral, "cpu")
    moe = _save(_hf.build("mixtral"), tmp_path / "mixtral", shard="10GB")
    with pytest.raises(OverlapConfigError, match=r"weight converters.*block_sparse_moe\.experts\.0\.w1\.weight"):
        fo.load_pretrained(mixtral, moe)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="only safetensors checkpoints"):
        fo.load_pretrained(other, tmp_path / "bin")


# ----------------------------------------------------------------- 2 gloo ranks
def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def _reference(folder: str, data: list[torch.Tensor]) -> list[float]:
    """``from_pretrained`` in one process, AdamW on whole batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).train()
    return _hf.train_reference(model, data, LR, optimizer=_adamw)[0]


def _train(model, rank, world, data, backward=None, optimizer=None) -> list[float]:
    opt = optimizer or _adamw(model.parameters())
    return _hf.train_sharded(model, rank, world, data, LR, optimizer=opt, backward=backward)


def _buffers_equal_normal_build(model: nn.Module, family: str) -> bool:
    want = dict(_hf.build(family).named_buffers())
    got = dict(model.named_buffers())
    return sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def _core_random(rank: int, world: int, family: str) -> dict:
    """The issue's case: meta build, parallelize, materialize; the first loss, no step."""
    import torch._dynamo
    import torch.distributed as dist

    torch._dynamo.reset()
    model = _meta(family)
    fo.parallelize(model, {"backend": "aot_eager"})
    fo.materialize(model, "cpu")
    with torch.no_grad():
        value = _hf.loss(model, local_slice(_hf.batches(1, 4)[0], rank, world)).detach()
    dist.all_reduce(value)
    norms = [w.full_tensor() for w in _norm_weights(model)]
    return {
        "first_loss": value.item() / world,
        "buffers_equal": _buffers_equal_normal_build(model, family),
        "norms_one": bool(norms) and all(bool((w == 1).all()) for w in norms),
        "embedding_std": model.get_input_embeddings()._parameters["weight"].full_tensor().std().item(),
    }


def _core_on_shards(rank: int, world: int) -> dict:
    """``full_init=False`` (the CUDA/NPU default: the initialisers run on the shards
    themselves; on CPU every rank draws the same values, but the mechanics are the same):
    a tied Llama with a padding row, which DTensor cannot write through an index."""
    model = _meta("llama", pad_token_id=60)  # row 60: on rank 1 (rows 49-96)
    fo.parallelize(model, {"backend": "aot_eager"})
    fo.materialize(model, "cpu", full_init=False)
    embedding = model.get_input_embeddings()._parameters["weight"].full_tensor()
    norms = [w.full_tensor() for w in _norm_weights(model)]
    return {
        "buffers_equal": _buffers_equal_normal_build(model, "llama"),
        "norms_one": all(bool((w == 1).all()) for w in norms),
        "padding_row_zero": torch.equal(embedding[60], torch.zeros(32)),
        "finite": bool(torch.isfinite(embedding).all()),
    }


def _core_loaded(rank: int, world: int, family: str, folder: str, data: list) -> dict:
    import torch._dynamo

    from fsdp_overlap_plugin.shard import weights

    torch._dynamo.reset()
    model = _meta(family)
    fo.parallelize(model, {"backend": "aot_eager"})
    fo.materialize(model, "cpu")
    reads = []  # (rows read, rows in the tensor) per sharded tensor loaded
    original = weights.local_box

    def recording(tensor):
        box = original(tensor)
        reads.append((box[0].start, box[0].stop, tensor.shape[0]))
        return box

    weights.local_box = recording
    try:
        info = fo.load_pretrained(model, folder)
    finally:
        weights.local_box = original
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    return {
        "losses": _train(model, rank, world, data),
        "files": info["files"],
        "reads": reads,
        "tied": emb._parameters["weight"] is head._parameters["weight"],
        "buffers_equal": _buffers_equal_normal_build(model, family),
    }


def _lightning_fit(rank: int, world: int, family: str, data: list, root: str, **module) -> dict:
    """examples/hf_lightning.py's module built on meta in configure_model (``weights``: a
    checkpoint loaded into the shards in on_fit_start; ``meta=True``: none), materialized by
    the strategy; this rank's slices of ``data``, one batch per step."""
    import torch._dynamo
    from _lightning import trainer
    from torch.utils.data import DataLoader, TensorDataset

    from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy

    sys.path.insert(0, str(ROOT / "examples"))
    import hf_lightning

    torch._dynamo.reset()
    lit = hf_lightning.CausalLMModule(lr=LR, **module)
    assert lit.model is None  # nothing built before configure_model
    local = torch.cat([local_slice(ids, rank, world) for ids in data])
    strategy = FSDPOverlapStrategy(backend="aot_eager")
    tr = trainer(root, max_epochs=1, strategy=strategy, precision="32-true", use_distributed_sampler=False)
    tr.fit(lit, DataLoader(TensorDataset(local), batch_size=len(local) // len(data)))
    return {"losses": lit.all_losses, "buffers_equal": _buffers_equal_normal_build(lit.model, family)}


def _fabric_loaded(rank: int, world: int, family: str, folder: str, data: list) -> dict:
    import torch._dynamo
    import transformers as T
    from lightning.fabric import Fabric

    from fsdp_overlap_plugin.lightning import FSDPOverlapFabricStrategy

    torch._dynamo.reset()
    fabric = Fabric(strategy=FSDPOverlapFabricStrategy(backend="aot_eager"), accelerator="cpu", devices=2)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = T.AutoModelForCausalLM.from_config(T.AutoConfig.from_pretrained(folder))
    on_meta = all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    wrapped = fabric.setup_module(model)
    fo.load_pretrained(model, folder)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    losses = _train(wrapped, rank, world, data, backward=fabric.backward, optimizer=optimizer)
    return {"losses": losses, "on_meta": on_meta, "buffers_equal": _buffers_equal_normal_build(model, family)}


def _accelerate_loaded(rank: int, world: int, family: str, folder: str, data: list) -> dict:
    import torch._dynamo
    import transformers as T
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from fsdp_overlap_plugin.accelerate import prepare

    torch._dynamo.reset()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator()
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(T.AutoConfig.from_pretrained(folder))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = prepare(accelerator, model, optimizer, config={"backend": "aot_eager"})
    fo.load_pretrained(model, folder)
    losses = _train(model, rank, world, data, backward=accelerator.backward, optimizer=optimizer)
    return {"losses": losses, "buffers_equal": _buffers_equal_normal_build(model, family)}


class _Scaled(nn.Module):
    """A plain PyTorch model with a parameter that has no initialiser."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.empty(8))

    def forward(self, x):
        return self.inner(x) * self.gain


def _square_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _warn_then_load(rank: int, world: int, path: str) -> dict:
    """on_uninitialized: warn through parallelize's config: zeros, then a plain safetensors
    file fills them; two SGD steps equal the unsharded model loaded the same way."""
    import warnings

    import torch._dynamo

    torch._dynamo.reset()
    with torch.device("meta"):
        model = _Scaled()
    fo.parallelize(model, {"backend": "aot_eager", "on_uninitialized": "warn"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fo.materialize(model, "cpu")
    warned = [str(w.message) for w in caught if issubclass(w.category, UninitializedWarning)]
    zero = bool((model._parameters["gain"].to_local() == 0).all())
    fo.load_pretrained(model, path)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(4, 8, generator=g) for _ in range(2)]
    losses = _hf.train_sharded(model, rank, world, xs, 0.1, loss_fn=_square_loss)
    return {"warned": warned, "zero": zero, "losses": losses, "xs": xs}


def _all(rank: int, world: int, folders: dict, data: list, root: str, plain: str) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    for family in LOAD_FAMILIES:
        folder = folders[family]
        out[family] = {
            "random": _core_random(rank, world, family),
            "core": _core_loaded(rank, world, family, folder, data),
            "lightning": _lightning_fit(rank, world, family, data, f"{root}/{family}", weights=folder),
            "fabric": _fabric_loaded(rank, world, family, folder, data),
            "accelerate": _accelerate_loaded(rank, world, family, folder, data),
        }
    out["warn"] = _warn_then_load(rank, world, plain)
    out["on_shards"] = _core_on_shards(rank, world)
    llama = _hf.config("llama")
    out["lightning_random"] = _lightning_fit(rank, world, "llama", data, f"{root}/random", config=llama, meta=True)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from safetensors.torch import save_file

    base = tmp_path_factory.mktemp("meta_init")
    data = _hf.batches(STEPS, 4)
    folders, references, normal_first = {}, {}, {}
    for family in LOAD_FAMILIES:
        source = _hf.build(family, seed=7)  # not what a seed-0 init gives
        with torch.no_grad():  # sharper embeddings and head than a fresh init: an unmistakable loss
            g = torch.Generator().manual_seed(7)
            for layer in {source.get_input_embeddings(), source.get_output_embeddings()}:
                layer.weight.normal_(std=1.0, generator=g)
        folders[family] = str(_save(source, base / family))
        references[family] = _reference(folders[family], data)
        with torch.no_grad():
            normal_first[family] = _hf.loss(_hf.build(family, seed=0), data[0]).item()
    torch.manual_seed(11)
    plain = _Scaled()
    with torch.no_grad():
        plain.gain.uniform_(0.5, 1.5)  # what the checkpoint holds for the tensor nothing initialises
    save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, str(base / "plain.safetensors"))
    out = run_ranks(_all, folders, data, str(base / "runs"), str(base / "plain.safetensors"), timeout=1200)
    for family in LOAD_FAMILIES:
        print(
            f"{family}: first loss meta-built {out[0][family]['random']['first_loss']:.4f}, normally built "
            f"{normal_first[family]:.4f}, loaded {out[0][family]['core']['losses'][0]:.4f} "
            f"(from_pretrained {references[family][0]:.4f})"
        )
    return {"ranks": out, "references": references, "plain": plain, "normal_first": normal_first}


@pytest.mark.slow
@pytest.mark.parametrize("family", LOAD_FAMILIES)
def test_a_meta_built_sharded_model_trains_from_its_library_init(results, family):
    """The regression: 0.1 left inv_freq and the norms uninitialised, first loss NaN."""
    for rank in results["ranks"]:
        random = rank[family]["random"]
        assert math.isfinite(random["first_loss"]), random
        assert random["buffers_equal"] and random["norms_one"]
        assert math.isclose(random["embedding_std"], 0.02, rel_tol=0.15), random["embedding_std"]
        # a fresh init predicts uniformly: about log(vocab), like the normally built model
        assert abs(random["first_loss"] - math.log(_hf.VOCAB)) < 0.1
        assert abs(random["first_loss"] - results["normal_first"][family]) < 0.1


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["core", "lightning", "fabric", "accelerate"])
@pytest.mark.parametrize("family", LOAD_FAMILIES)
def test_weights_loaded_into_the_shards_train_like_from_pretrained(results, family, entry):
    want = results["references"][family]
    for rank in results["ranks"]:
        got = rank[family][entry]
        assert got["buffers_equal"]
        losses = got["losses"]
        if entry == "lightning":  # every rank's local losses per step: their mean
            losses = [sum(step) / len(step) for step in zip(*losses)]
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
        # fp32 both; other matmul shapes and summation orders: rounding only
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses, want)), (entry, losses, want)
    core = results["ranks"][0][family]["core"]
    assert core["files"] > 1  # a checkpoint of several safetensors files
    if entry == "core":  # each rank read only its rows: chunk semantics, ceil(rows / 2) first
        for rank, result in enumerate(results["ranks"]):
            reads = result[family]["core"]["reads"]
            assert reads and all(
                stop - start == (-(-rows // 2) if rank == 0 else rows // 2) for start, stop, rows in reads
            )
            assert all(start == (0 if rank == 0 else -(-rows // 2)) for start, _, rows in reads)
    if family in ("llama", "gpt2"):
        assert core["tied"]  # tied weights stay one parameter
    if entry == "fabric":
        assert results["ranks"][0][family]["fabric"]["on_meta"]
    assert abs(want[0] - math.log(_hf.VOCAB)) > 1.0  # the checkpoint's loss is unmistakable


@pytest.mark.slow
def test_on_uninitialized_warn_trains_after_a_checkpoint_fills_them(results):
    xs = results["ranks"][0]["warn"]["xs"]
    want, _ = _hf.train_reference(results["plain"], xs, 0.1, loss_fn=_square_loss)
    for rank in results["ranks"]:
        warn = rank["warn"]
        assert len(warn["warned"]) == 1 and "gain" in warn["warned"][0] and warn["zero"]
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(warn["losses"], want)), (warn["losses"], want)


@pytest.mark.slow
def test_initialisers_on_the_shards_write_every_row(results):
    for rank in results["ranks"]:
        assert rank["on_shards"] == {"buffers_equal": True, "norms_one": True, "padding_row_zero": True, "finite": True}


@pytest.mark.slow
def test_lightning_configure_model_on_meta_trains_without_a_checkpoint(results):
    for rank in results["ranks"]:
        random = rank["lightning_random"]
        assert random["buffers_equal"]
        losses = [sum(step) / len(step) for step in zip(*random["losses"])]
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
        assert abs(losses[0] - math.log(_hf.VOCAB)) < 0.1  # a fresh init: about log(vocab)
