"""Tiny Hugging Face ``transformers`` models built from a config (no hub access), for
tests that must run against code nobody here wrote.

Every family has an odd vocabulary (97: shards of 49 and 48 rows on 2 ranks), dropout
off (transformers models from a config are in train mode; GPT-2's default dropout is
0.1), and a width small enough that a 2-rank step takes seconds on one core. The blocks
differ in structure on purpose:

* ``llama``   tied embeddings, grouped-query attention, RMSNorm (forward decorated with
              ``*args`` wrappers: Dynamo calls the model ``L['args'][0]``)
* ``qwen2``   attention biases, untied head
* ``gpt2``    ``Conv1D`` layers, learned positions, tied head, no ``loss_type``
* ``mixtral`` a sparse mixture-of-experts block (router + experts)
* ``neox``    parallel attention and MLP (two biases with the same gradient, whose
              reduce-scatters AOT autograd merges)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 97
SEQ = 16
FAMILIES = ("llama", "qwen2", "gpt2", "mixtral", "neox")

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)


def config(family: str, **overrides):
    """The family's transformers config; ``overrides`` replace or add config fields."""
    import transformers as T

    common = dict(_COMMON, num_key_value_heads=2)
    classes_and_fields = {
        "llama": (T.LlamaConfig, dict(common, tie_word_embeddings=True)),
        "qwen2": (T.Qwen2Config, dict(common, tie_word_embeddings=False)),
        "gpt2": (
            T.GPT2Config,
            dict(
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=64,
                resid_pdrop=0,
                embd_pdrop=0,
                attn_pdrop=0,
                bos_token_id=0,
                eos_token_id=0,
            ),
        ),
        "mixtral": (T.MixtralConfig, dict(common, num_local_experts=4, num_experts_per_tok=2)),
        "neox": (T.GPTNeoXConfig, dict(_COMMON, hidden_dropout=0, attention_dropout=0, tie_word_embeddings=False)),
    }
    if family not in classes_and_fields:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    cls, fields = classes_and_fields[family]
    return cls(**{**fields, **overrides})


# Per family: is the head tied to the embedding, and the names the head and the embedding
# are stored under in a save_pretrained folder (transformers' own names on disk: GPT-NeoX's
# head is ``lm_head`` in the model and ``embed_out`` in its files).
TIED = {"llama": True, "qwen2": False, "gpt2": True, "mixtral": False, "neox": False}
STORED_HEAD_AND_EMBEDDING = {
    "llama": ("lm_head.weight", "model.embed_tokens.weight"),
    "qwen2": ("lm_head.weight", "model.embed_tokens.weight"),
    "gpt2": ("lm_head.weight", "transformer.wte.weight"),
    "mixtral": ("lm_head.weight", "model.embed_tokens.weight"),
    "neox": ("embed_out.weight", "gpt_neox.embed_in.weight"),
}


def stored_entries(folder: str | Path) -> dict[str, str]:
    """``{entry: file}`` of every tensor the safetensors files of a ``save_pretrained``
    folder hold, read from the files' own headers (never from ``config.json``, never
    loading a tensor). Raises ``AssertionError`` when two files hold one entry, or when the
    folder's ``model.safetensors.index.json`` names other entries or files than the headers."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    assert files, f"{folder}: no .safetensors file"
    entries: dict[str, str] = {}
    for path in files:
        with open(path, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        for name in header:
            if name == "__metadata__":
                continue
            assert name not in entries, f"{folder}: {name} is in both {entries[name]} and {path.name}"
            entries[name] = path.name
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        wrong = sorted(k for k in weight_map.keys() | entries.keys() if weight_map.get(k) != entries.get(k))
        assert not wrong, f"{index.name} disagrees with the files' headers on {wrong[:4]} ({len(wrong)} entries)"
    return entries


def head_storage_problems(folder: str | Path, family: str, tied: bool | None = None) -> list[str]:
    """What is wrong with how the folder's files store the head and the embedding of a
    ``family`` model, each problem naming the file and the entry; ``[]`` when nothing is.
    Tied (``tied``, by default the family's ``TIED``): the embedding is stored and the head
    is not (``from_pretrained`` ties it back; a stored copy is what transformers leaves out,
    and would be loaded as a second tensor or silently dropped). Untied: both are stored."""
    tied = TIED[family] if tied is None else tied
    head, embedding = STORED_HEAD_AND_EMBEDDING[family]
    entries = stored_entries(folder)
    problems = []
    if embedding not in entries:
        problems.append(f"{folder}: no file holds the embedding {embedding}")
    if tied and head in entries:
        problems.append(
            f"{folder}/{entries[head]} holds {head}, but the head is tied to {embedding}: "
            "the files of a tied model leave the head out"
        )
    if not tied and head not in entries:
        files = sorted(set(entries.values()))
        problems.append(f"{folder}: no file holds {head} ({', '.join(files)}), and the untied head must be stored")
    return problems


def build(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The family's causal LM, seeded, in ``dtype``."""
    import transformers as T

    torch.manual_seed(seed)
    return T.AutoModelForCausalLM.from_config(config(family)).to(dtype)


def batches(steps: int, batch: int, seq: int = SEQ, seed: int = 1234) -> list[torch.Tensor]:
    """Token ids per step; the model's own ``labels=input_ids`` loss shifts them."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(steps)]


def loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def expected_collectives(model: torch.nn.Module, plan: list[list[str]]) -> tuple[int, int]:
    """``(forward all-gathers, backward reduce-scatters)`` the passes must leave, read from
    the plan: one of each per entry holding a parameter no earlier entry holds. A tied
    weight is one gather (AOT autograd merges its reads' identical gathers into the first)
    and one reduce-scatter (the passes sum its uses' gradients first), both in the first
    entry holding it, so an entry holding only the tied ``lm_head.weight`` moves nothing
    of its own."""
    seen: set[int] = set()
    count = 0
    for entry in plan:
        params = {id(p) for fqn in entry for p in model.get_submodule(fqn).parameters()}
        count += bool(params - seen)
        seen |= params
    return count, count


def train_sharded(
    model, rank: int, world: int, data: list[torch.Tensor], lr: float, *, optimizer=None, backward=None, loss_fn=None
) -> list[float]:
    """SGD (or ``optimizer``) on this rank's slice of each batch of ``data``; the mean loss
    over ranks per step. ``backward``: e.g. ``fabric.backward``; ``loss_fn(model, batch)``:
    the model's own causal-LM loss by default."""
    import torch.distributed as dist
    from _train import local_slice

    opt = optimizer or torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for ids in data:
        value = (loss_fn or loss)(model, local_slice(ids, rank, world))
        (backward or torch.Tensor.backward)(value)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = value.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    return losses


def train_reference(
    model, data: list[torch.Tensor], lr: float, *, optimizer=None, loss_fn=None
) -> tuple[list[float], dict]:
    """The same SGD (or ``optimizer(params)``) on a copy of ``model`` in one process, on
    whole batches: ``(losses, final full parameters)``."""
    import copy

    from _train import full_params

    model = copy.deepcopy(model)
    opt = (optimizer or (lambda params: torch.optim.SGD(params, lr=lr)))(model.parameters())
    losses = []
    for ids in data:
        value = (loss_fn or loss)(model, ids)
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(value.item())
    return losses, full_params(model)


#: a sequence-parallel tp_plan of the tests' Llama / Qwen2 (tests/shard: test_sequence_parallel*.py)
SP_PLAN = {
    "model.embed_tokens": "rowwise",
    "model.layers.*.input_layernorm": "sequence_parallel",
    "model.layers.*.self_attn.[qkv]_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.post_attention_layernorm": "sequence_parallel",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.norm": "sequence_parallel",
    "lm_head": "colwise",
}
