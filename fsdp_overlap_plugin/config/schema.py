"""OverlapConfig: every knob of the plugin, with its default and its validation.

The field docstrings below *are* the user documentation: ``OverlapConfig.describe()``
prints them, ``docs/config.md`` is generated from them, and the YAML files in
``configs/`` use the same names. Every way of building a config (keyword arguments,
``from_dict``, ``from_yaml``) goes through ``validate()``, so a typo or a wrong type
fails at startup with the key named and the nearest valid choice suggested.

Reading a YAML file, a byte count or a dtype name is ``config.parse``'s job; writing
``docs/config.md`` is ``config.docs``'s.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..contract import AC_POLICIES, OverlapConfigError
from .keys import check_keys, suggest
from .mesh import MeshConfig, mesh_from_value
from .parse import dtype_name, format_bytes, parse_bytes, parse_dtype, read_yaml
from .tp_plan import check_tp_plan

__all__ = [
    "MeshConfig",
    "OverlapConfig",
    "OverlapConfigError",
    "prefetch_words",
    "respell",
]


# Keys that only the cost model's predictions read: training is the same whatever they say.
PREDICTION_ONLY = ("hardware", "compute_profile")

# How the report and `fsdp-overlap check` name OverlapConfig.memory_order's values.
MEMORY_ORDER_WORDS = {
    "fsdp2": "FSDP2's memory order: prefetch after the copy-out, one reduce-scatter in flight",
    "queued": "collectives queued back to back",
}


def prefetch_words(depth: int, budget: int | None, order: str) -> str:
    """``depth 1, budget none; collectives queued back to back``: the prefetch settings
    in the words of both the schedule report and ``fsdp-overlap check``."""
    return f"depth {depth}, budget {'none' if budget is None else format_bytes(budget)}; {MEMORY_ORDER_WORDS[order]}"


_BACKENDS = ("inductor", "aot_eager")
_REDUCE_SCATTER_IMPLS = ("auto", "native", "all_to_all", "receive_first")
_RANK_CHECK = ("error", "warn", "off")
_DYNAMIC = ("auto", True, False)
_ON_COMPILE_ERROR = ("raise", "eager")
_INDUCTOR_OVERLAP = ("off", "simple", "auto")  # inductor_overlap.SETTINGS (which imports torch's inductor config)
_ON_UNBUCKETED = ("error", "warn")
ON_UNINITIALIZED = ("error", "warn")


@dataclass
class OverlapConfig:
    """Configuration of fsdp-overlap (FSDP2 sharding, compile, and the overlap passes)."""

    bucket_plans: str | list = "auto"
    """Which modules' collectives are merged into one bucket: "auto" (one bucket per repeated
    block of the model's largest ModuleList/Sequential; the modules before and after the blocks
    are grouped into buckets of about bucket_bytes), or a list whose entries are a module FQN ("layers.0") or a list of FQNs
    (["norm", "output"]) forming one bucket. FQNs are relative to the model root. A string
    entry with a glob ("layers.*") or numeric range ("layers.[0-3]") expands to one bucket per
    matching module, in module order; inside a list entry it adds all matches to that bucket."""

    bucket_bytes: int | str | None = None
    """Target size of an auto-plan bucket, in bytes as gathered (in param_dtype). Consecutive
    modules outside the repeated blocks (embeddings, norms, heads) merge into one bucket until
    it reaches this size; such a module larger than the target is split into its children
    when it holds no parameters of its own; a repeated block always stays one bucket, however
    large. null uses the size of one repeated block (the median), so merging never makes a
    bucket much larger than a block and prefetch memory stays what the blocks already need;
    16 MiB for a model without repeated blocks. An integer or a string such as "64MiB" or
    "500KB"; 1 gives every such module its own bucket. Only read when bucket_plans is "auto"
    (docs/tuning.md explains the choice)."""

    manual_bucketing: bool = True
    """Merge the all-gathers and reduce-scatters of each plan entry into one collective, and
    prefetch the next bucket's all-gather while the current bucket computes."""

    overlap_grad_reduce: bool = True
    """Launch each gradient reduce-scatter as soon as its gradient exists, and wait for it where
    the reduced gradient is first used, or at the latest once the next reduce-scatter on its
    group has launched (as FSDP2 does: its full-size input is freed there; under
    max_prefetch_bytes before the next one packs its input)."""

    reshard_after_forward: bool = True
    """Free gathered parameters after forward and re-gather them in backward (less memory,
    more communication), as FSDP2's reshard_after_forward=True."""

    reshard_last_bucket: bool = False
    """Also reshard the last forward bucket. Off by default: backward starts with exactly
    those parameters, and re-gathering them at once cannot be hidden (FSDP2 keeps the root
    unsharded for the same reason). With manual_bucketing the forward keeps the last
    prefetch_depth buckets, and one more where those gather fewer bytes than the bucket
    before them (a final norm and small head before a block: too short a backward to hide
    the block's re-gather); max_prefetch_bytes limits both. Only read when
    reshard_after_forward is true."""

    param_dtype: str | None = None
    """Dtype parameters are gathered and computed in: "bf16", "fp16", "fp32", or null (keep the
    parameter's own dtype). The sharded master copy keeps its dtype."""

    reduce_dtype: str | None = None
    """Dtype gradients are reduce-scattered in: "bf16", "fp16", "fp32", or null (same as
    param_dtype when set, else the parameter's dtype)."""

    compile: bool = True
    """Compile the model with torch.compile so the passes can see its collectives. False falls
    back to eager FSDP2 fully_shard per plan entry (no passes)."""

    backend: str = "inductor"
    """torch.compile backend: "inductor" (generated code) or "aot_eager" (ATen graphs run
    eagerly; quick to compile, useful for debugging)."""

    fullgraph: bool = True
    """Require one graph for the whole forward. A graph break leaves collectives outside the
    graph, where they are not overlapped."""

    dynamic: str | bool = "auto"
    """Whether sizes may vary between calls without a recompile, as torch.compile(dynamic=...):
    "auto" compiles the first call's sizes as constants and, at the first call whose sizes
    differ (a batch padded to another sequence length), once more with those sizes
    symbolic, which then serves every length: two compiles in all; true compiles every
    input size symbolic from the first call (one compile, but the batch size becomes a
    symbol too, which made that compile about twice as long as auto's two on the test
    Llama; sizes 0 and 1 still get their own); false
    compiles every new size anew (Dynamo's recompile_limit, 8, then stops the run with
    RecompileLimitError). Buckets depend on parameter sizes only, so every length gets the
    same buckets and overlap. Each rank may pad its own batches to its own length."""

    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Device mesh, {shard: -1, replicate: 1, tensor: 1}; replicate > 1 means HSDP; tensor > 1
    means tensor parallelism inside each group of tensor consecutive ranks (with a tp_plan or
    the model's own parallelize_module), FSDP over the other dimensions
    (docs/tensor-parallel.md)."""

    tp_plan: dict | str | None = None
    """Tensor-parallel plan, applied over the mesh's tensor dimension before sharding: "auto"
    (a transformers model's own plan, the colwise and rowwise entries of its _tp_plan: the
    decoder layers' attention and MLP projections; its embedding and head stay whole), or a
    mapping of module FQNs or patterns ("layers.*.mlp.up_proj") to a style: "colwise" (a
    Linear's or Embedding's output features split), "rowwise" (its input features split; the
    output all-reduced), "replicate" (left whole on every tensor-parallel rank: data
    parallel only; modules no entry names are left whole too) or "sequence_parallel" (a norm
    run on sequence shards: the plan becomes Megatron's sequence parallelism, with the token
    embedding rowwise, every norm sequence_parallel and the head colwise; rowwise layers then
    reduce-scatter to sequence shards and colwise ones gather their input from them;
    docs/tensor-parallel.md#sequence-parallelism). null: no plan of ours (the
    model may have been parallelized by the user's own code). Needs mesh.tensor > 1 (under
    Accelerate: parallelism_config_tp_size; docs/tensor-parallel.md)."""

    async_tp: bool = False
    """Inductor's micro-pipelined tensor parallelism ("async TP"): each all-gather that feeds
    a matmul and each matmul that feeds a reduce-scatter on the tensor-parallel group run as
    one fused kernel that splits the transfer into chunks and multiplies each chunk as it
    arrives, over CUDA symmetric memory. Needs mesh.tensor > 1, compile with backend
    inductor, NCCL on CUDA GPUs, and a plan whose collectives are all-gathers and
    reduce-scatters (sequence parallelism); with only all-reduces there is nothing to fuse,
    and that is an error at the first compile, as is gloo, hccl or aot_eager at startup.
    Not yet run on a GPU: checked on CPUs with torch's symmetric-memory test mode
    (docs/tensor-parallel.md#async-tp)."""

    activation_checkpointing: list = field(default_factory=list)
    """Module FQNs or patterns ("layers.*") whose forward is recomputed in backward. A
    transformers model's own gradient_checkpointing_enable() adds the layers it flagged."""

    activation_checkpointing_policy: str = "full"
    """What a checkpointed module keeps for backward: "full" (only its input; everything
    is recomputed) or "matmuls_saved" (also the outputs of matrix multiplications and
    attention; norms, activations and elementwise ops are recomputed)."""

    separate_gather_group: bool | None = None
    """Run parameter all-gathers on their own process group so a reduce-scatter issued earlier
    on the same communicator cannot delay the next prefetch. null = on for nccl/hccl, off for
    gloo (gloo runs each group's collectives on worker threads already)."""

    reduce_scatter_impl: str = "auto"
    """How gradient reduce-scatters run: "native" (the backend's reduce_scatter_tensor),
    "all_to_all" (all_to_all_single plus a local sum), "receive_first" (gloo only: those
    all-to-alls on a group of the shard group's ranks that posts every receive before any
    send) or "auto": per backend and shard-group size, the one that moves the fewest bytes
    while bitwise equal to native. On gloo, whose reduce_scatter_tensor is a clone plus a
    full all-reduce, the all-to-all sends half the bytes; it is bitwise equal on 2 ranks per
    shard group (checked on 2, 3 and 4), and only equal up to summation order on more.
    gloo's own all-to-all sends before it receives, so on a slow link the two directions
    take turns; "receive_first" moves the same bytes with both directions busy (0.728 vs
    0.794 s per step on the repo GPT at 300 Mbit on 2 ranks, benchmarks/RESULTS.md),
    bitwise equal to "all_to_all". So "auto" picks "receive_first" on gloo with 2 ranks per
    shard group and native everywhere else (nccl, hccl, gloo with more ranks);
    "receive_first" is an error on nccl/hccl. The report says which ran and why. Only read
    with compile: true."""

    prefetch_depth: int = 1
    """How many buckets ahead parameter all-gathers launch, in forward and backward: 1
    launches bucket i+1's while bucket i computes; 2 also bucket i+2's (more overlap on a
    slow link, one more bucket of gathered parameters alive). Limited per bucket by
    max_prefetch_bytes. Only read with manual_bucketing: true."""

    max_prefetch_bytes: int | str | None = None
    """Budget of gathered parameter bytes (in param_dtype, per rank) that prefetching may keep
    alive at once: a bucket's all-gather launches as many buckets ahead (up to
    prefetch_depth) as keeps the bucket being consumed, those launched before it and itself
    within the budget; where even one bucket ahead does not fit it is not prefetched. Under a
    budget the schedule also follows FSDP2's memory order: each prefetch launches after the
    copy-out of the bucket before it (so the budget is all that is gathered), and each gradient
    reduce-scatter is waited before the next one's copy-in (one in flight). Without one, a
    prefetch is queued before that bucket's wait and a reduce-scatter waited after the next
    launch (faster on a slow link; one bucket more of each at its moment). null: no budget
    (prefetch_depth alone decides). An integer or a string such as "256MiB". fsdp-overlap
    check prints the resulting peak and which order runs; so does the schedule report."""

    inductor_overlap: str = "off"
    """What inductor's own distributed passes may do to our compiled graphs, after our passes:
    "off" (none of them runs: the code keeps the order our passes decided, the one the report
    describes), "simple" (torch 2.14+'s simple overlap: each collective launch moved earlier
    and each wait later by adjacent swaps, never past another collective, only where peak
    memory does not grow; torch's own default since 2.14) or "auto" (torch's bucketing and
    overlap scheduler, which replaces our schedule: only with manual_bucketing and
    overlap_grad_reduce false; off CUDA it is given the hardware setting's rates). "off" on
    every device: on our graphs "simple" moved nothing in the benchmarks but single-parameter
    buckets' all-gathers, which it launched earlier than prefetch_depth allows, and it cannot
    see collectives inside custom ops (pytorch issue 189454). Applied to our compiles only,
    through inductor's config patches. Only read with backend: inductor; the report names
    which of torch's passes ran. docs/performance.md has the measurements."""

    hardware: str | dict | None = None
    """The machine the report's predictions (and ``fsdp-overlap check`` / ``inspect`` /
    ``suggest``) assume: a preset name (h100-nvlink, h200-nvlink, h100-ib400, h100-ib200,
    h100-roce400, ascend-910b-hccs, cpu-gloo-300mbit; each with its source in
    docs/performance.md), your own numbers ("link=100GB/s,inter_link=25GB/s,flops=300TFLOP/s",
    or the same as a mapping), or a preset with some numbers changed ("h100-ib400,
    link=300GB/s"). ``link``: bytes/s per rank the shard group's collectives move (bus
    bandwidth); ``inter_link``: the same between replicas (HSDP); ``flops``: FLOP/s a training
    step achieves; ``latency``: per collective. null: the preset of the device type (cuda:
    h100-nvlink, npu: ascend-910b-hccs, cpu: cpu-gloo-300mbit). Read by the predictions and,
    off CUDA, by torch's overlap scheduler under inductor_overlap: auto (its cost model);
    the numbers trained are the same whatever it says."""

    compute_profile: str | None = None
    """A measured compute profile (JSON with ``achieved_flops_per_s``: written by
    ``fsdp-overlap profile`` on this machine, or by benchmarks/gpu_check.py's world8 phase on
    a GPU) whose achieved FLOP/s replaces the compute rate of ``hardware`` in predictions.
    null: the preset's rate. Read when the report is made; a missing or malformed file is an
    error at startup."""

    rank_check: str = "error"
    """Before any rank runs a new graph, every rank compares it with rank 0's through the
    process group's store: a fingerprint of the graph (operations, dtypes, number of
    dimensions, plan; not sizes, which may differ when each rank pads its own batch) and the
    collectives the passes left (kind, group size, bytes, order, and the passes' decisions).
    "error" stops every rank on a mismatch, naming the first difference; "warn" only warns;
    "off" skips the check. A recompile that leaves collectives the ranks already agreed on
    (a new sequence length) is not compared again. Ranks running different graphs would
    otherwise issue collectives that never match, and hang."""

    rank_check_timeout: float = 300.0
    """Seconds a rank waits for the others at a rank check or compile agreement, or at an
    export (``save_pretrained``, ``accelerator.get_state_dict``: every rank must call them),
    before it stops with an error naming the ranks that did not arrive (so none can hang)."""

    on_compile_error: str = "raise"
    """What a compile failure does: "raise" stops every rank with the error (a rank that
    compiled fine is told which rank failed, instead of waiting for it in a collective);
    "eager" makes every rank run the same sharded model without compiling (the collectives
    FSDP2 would run, no passes, same numerics), with a warning."""

    on_unbucketed: str = "error"
    """What a compiled graph whose bucketing missed a plan entry's collectives does: "error"
    stops every rank at the first step, naming the entry, how many collectives were left and
    the module path Dynamo reported for one; "warn" warns and trains without those buckets.
    Collectives of parameters that no plan entry covers only warn either way. Checked on FX
    graph cache hits too, from the record the passes left."""

    on_uninitialized: str = "error"
    """What ``materialize`` does with a meta-device parameter or buffer that no initialiser
    wrote (no reset_parameters(), not covered by a transformers model's _init_weights):
    "error" stops, naming it; "warn" warns and sets it to zero, for tensors a checkpoint
    loaded next will fill. NaN or inf in any parameter or buffer after initialisation is
    an error either way."""

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, *, source: str = "config") -> OverlapConfig:
        """Build a config from a plain mapping; unknown keys are an error naming the nearest key."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise OverlapConfigError(f"{source}: expected a mapping of config keys, got {type(data).__name__}.")
        check_keys(data, [f.name for f in dataclasses.fields(cls)], source=source)
        kwargs = dict(data)
        if "mesh" in kwargs:
            kwargs["mesh"] = mesh_from_value(kwargs["mesh"], source)
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path) -> OverlapConfig:
        """Load a plugin YAML file (a mapping of the keys of this class)."""
        return cls.from_dict(read_yaml(path), source=str(path))

    @classmethod
    def coerce(cls, config: OverlapConfig | dict | str | Path | None, **overrides: Any) -> OverlapConfig:
        """Accept a config object, a dict, a YAML path or None, then apply keyword overrides."""
        if isinstance(config, OverlapConfig):
            if not overrides:
                return config
            data, source = config.to_dict(), "config"
        elif isinstance(config, (str, Path)):
            data, source = read_yaml(config), str(config)
        elif config is None or isinstance(config, dict):
            data, source = config or {}, "config"
        else:
            raise OverlapConfigError(
                f"config: expected an OverlapConfig, a dict or a YAML path, got {type(config).__name__}."
            )
        if not overrides:
            return cls.from_dict(data, source=source)
        # validated once, with the overrides applied: the base's keys are checked first, so
        # an unknown key there is named as the base's, not as a keyword argument's
        if not isinstance(data, dict):
            raise OverlapConfigError(f"{source}: expected a mapping of config keys, got {type(data).__name__}.")
        check_keys(data, [f.name for f in dataclasses.fields(cls)], source=source)
        merged = dict(data)
        if "mesh" in merged and "mesh" not in overrides:
            merged["mesh"] = mesh_from_value(merged["mesh"], source)
        merged.update(overrides)
        return cls.from_dict(merged, source="keyword arguments")

    def to_dict(self) -> dict[str, Any]:
        """A plain, YAML-serialisable mapping of all fields."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> OverlapConfig:
        """A validated copy with some fields changed."""
        merged = self.to_dict()
        merged.update(changes)
        return type(self).from_dict(merged)

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check every field; raise OverlapConfigError naming the key at fault."""
        self.bucket_plans = _check_plans(self.bucket_plans)
        self.bucket_bytes = parse_bytes(self.bucket_bytes, "bucket_bytes")
        for name in (
            "manual_bucketing",
            "overlap_grad_reduce",
            "reshard_after_forward",
            "reshard_last_bucket",
            "compile",
            "fullgraph",
            "async_tp",
        ):
            _check_bool(name, getattr(self, name))
        if self.separate_gather_group is not None:
            _check_bool("separate_gather_group", self.separate_gather_group)
        if self.dynamic not in _DYNAMIC or (isinstance(self.dynamic, int) and not isinstance(self.dynamic, bool)):
            raise OverlapConfigError(
                f"dynamic: unknown value {self.dynamic!r}; valid: auto, true, false (as torch.compile's dynamic: "
                "auto is its None)."
            )
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            parse_dtype(value, name)
            if isinstance(value, torch.dtype):
                setattr(self, name, dtype_name(value))
            elif isinstance(value, str):
                setattr(self, name, dtype_name(parse_dtype(value, name)))
        for name, choices in (
            ("rank_check", _RANK_CHECK),
            ("on_compile_error", _ON_COMPILE_ERROR),
            ("on_unbucketed", _ON_UNBUCKETED),
            ("on_uninitialized", ON_UNINITIALIZED),
            ("activation_checkpointing_policy", AC_POLICIES),
            ("inductor_overlap", _INDUCTOR_OVERLAP),
        ):
            value = getattr(self, name)
            if value not in choices:
                raise OverlapConfigError(
                    f"{name}: unknown value {value!r}; valid: {', '.join(choices)}.{suggest(str(value), choices)}"
                )
        from .hardware import load_profile, parse_hardware

        try:
            parse_hardware(self.hardware)
        except ValueError as exc:
            raise OverlapConfigError(str(exc)) from None
        if self.compute_profile is not None:
            if not isinstance(self.compute_profile, (str, Path)):
                raise OverlapConfigError(
                    f"compute_profile: expected the path of a JSON profile, got {self.compute_profile!r}."
                )
            self.compute_profile = str(self.compute_profile)
            try:
                load_profile(self.compute_profile)
            except ValueError as exc:
                raise OverlapConfigError(str(exc)) from None
        timeout = self.rank_check_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise OverlapConfigError(f"rank_check_timeout: expected a positive number of seconds, got {timeout!r}.")
        self.rank_check_timeout = float(timeout)
        depth = self.prefetch_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise OverlapConfigError(
                f"prefetch_depth: expected an integer >= 1 (buckets launched ahead), got {depth!r}."
            )
        self.max_prefetch_bytes = parse_bytes(self.max_prefetch_bytes, "max_prefetch_bytes")
        if self.reduce_scatter_impl not in _REDUCE_SCATTER_IMPLS:
            raise OverlapConfigError(
                f"reduce_scatter_impl: unknown value {self.reduce_scatter_impl!r}; valid: "
                f"{', '.join(_REDUCE_SCATTER_IMPLS)}.{suggest(str(self.reduce_scatter_impl), _REDUCE_SCATTER_IMPLS)}"
            )
        if not isinstance(self.backend, str) or self.backend not in _BACKENDS:
            raise OverlapConfigError(
                f"backend: unknown backend {self.backend!r}; valid: {', '.join(_BACKENDS)}.{suggest(str(self.backend), _BACKENDS)}"
            )
        if self.async_tp and (not self.compile or self.backend != "inductor"):
            raise OverlapConfigError(
                "async_tp: inductor's micro-pipelined tensor parallelism is an inductor pass; this config has "
                + ("compile: false" if not self.compile else f"backend: {self.backend}")
                + ". Set compile: true and backend: inductor, or async_tp: false."
            )
        if self.compile and self.inductor_overlap != "off":
            from .inductor_overlap import setting_error

            problem = setting_error(
                self.inductor_overlap, self.manual_bucketing or self.overlap_grad_reduce, self.backend
            )
            if problem:
                raise OverlapConfigError(problem)
        self.mesh = mesh_from_value(self.mesh, "config")
        for name in ("shard", "replicate", "tensor"):
            value = getattr(self.mesh, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise OverlapConfigError(f"mesh.{name}: expected an integer, got {value!r}.")
        if self.mesh.replicate < 1:
            raise OverlapConfigError(f"mesh.replicate: must be >= 1, got {self.mesh.replicate}.")
        if self.mesh.shard == 0 or self.mesh.shard < -1:
            raise OverlapConfigError(f"mesh.shard: must be >= 1, or -1 for 'the rest', got {self.mesh.shard}.")
        if self.mesh.tensor < 1:
            raise OverlapConfigError(f"mesh.tensor: must be >= 1, got {self.mesh.tensor}.")
        self.tp_plan = check_tp_plan(self.tp_plan)
        ac = self.activation_checkpointing
        if ac is None:
            self.activation_checkpointing = []
        elif isinstance(ac, str):
            self.activation_checkpointing = [ac]
        elif not isinstance(ac, (list, tuple)) or not all(isinstance(x, str) and x for x in ac):
            raise OverlapConfigError(
                f"activation_checkpointing: expected a list of module FQNs or patterns, got {ac!r}."
            )
        else:
            self.activation_checkpointing = list(ac)

    @property
    def torch_param_dtype(self) -> torch.dtype | None:
        return parse_dtype(self.param_dtype, "param_dtype")

    @property
    def torch_reduce_dtype(self) -> torch.dtype | None:
        return parse_dtype(self.reduce_dtype, "reduce_dtype") or self.torch_param_dtype

    @property
    def memory_order(self) -> str:
        """The order the passes give collectives around their copies: "fsdp2" under a
        max_prefetch_bytes budget (each prefetch after the previous bucket's copy-out, each
        reduce-scatter waited before the next one's copy-in), "queued" without one (a prefetch
        queued before the bucket's wait, a reduce-scatter waited after the next launch)."""
        return "queued" if self.max_prefetch_bytes is None else "fsdp2"

    # ------------------------------------------------------------ documentation
    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """Field name -> its docstring (the text under the field in this file)."""
        return _attribute_docstrings(cls)

    @classmethod
    def describe(cls) -> str:
        """Every key with its default and documentation, as a user reads it in ``--help``."""
        lines = []
        docs = cls.field_docs()
        defaults = cls().to_dict()
        for name, doc in docs.items():
            lines.append(f"{name} (default: {defaults[name]!r})")
            lines.extend("    " + line for line in textwrap.wrap(doc, 84))
        return "\n".join(lines)


def respell(message: str, spell: Callable[[str], str]) -> str:
    """A core error whose message starts with a field name (``bucket_plans[2]: ...``,
    ``mesh.replicate=3 ...``), with that key written as the user's file spells it
    (``spell("bucket_plans")`` -> ``"fsdp_config.fsdp_overlap_bucket_plans"``)."""
    for name in sorted((f.name for f in dataclasses.fields(OverlapConfig)), key=len, reverse=True):
        if re.match(rf"{re.escape(name)}(?=[:\[.\s=])", message):
            return spell(name) + message[len(name) :]
    return message


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """Read the string literal after each annotated attribute of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


#: async_tp with no tensor dimension (``preflight`` on the config's mesh, ``compile/async_tp.py`` on the run's)
ASYNC_TP_NEEDS_TENSOR = (
    "async_tp: needs a tensor-parallel dimension to run on: mesh.tensor > 1 (Lightning's tensor_parallel_size, "
    "Accelerate's parallelism_config_tp_size) and a tp_plan or your own parallelize_module; this model has none. "
    "Set async_tp: false."
)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise OverlapConfigError(f"{name}: expected true or false, got {value!r} ({type(value).__name__}).")


def _check_plans(plans: Any) -> str | list:
    """Shape check only; names are checked against the model by plan.resolve_plan."""
    if isinstance(plans, str):
        if plans != "auto":
            raise OverlapConfigError(
                f'bucket_plans: expected "auto" or a list of module FQNs, got the string {plans!r}. '
                f"For a single bucket write [{plans!r}]."
            )
        return plans
    if isinstance(plans, tuple):
        plans = list(plans)
    if not isinstance(plans, list):
        raise OverlapConfigError(
            f'bucket_plans: expected "auto" or a list of module FQNs / lists of FQNs, got {type(plans).__name__}.'
        )
    if not plans:
        raise OverlapConfigError(
            'bucket_plans: the plan is empty. Use "auto", list module FQNs, or set '
            "manual_bucketing: false to turn bucketing off."
        )
    out: list = []
    for i, entry in enumerate(plans):
        if isinstance(entry, str) and entry:
            out.append(entry)
        elif isinstance(entry, (list, tuple)) and entry and all(isinstance(x, str) and x for x in entry):
            out.append(list(entry))
        else:
            raise OverlapConfigError(
                f"bucket_plans[{i}]: expected a module FQN or a non-empty list of FQNs, got {entry!r}."
            )
    return out
