"""What a training step costs, predicted from the bucket plan before any run: ``check`` and
``inspect`` print it, ``suggest`` searches bucket sizes and prefetch depths with it.

Each bucket's bytes come from ``analysis.bucket_rows`` (what ``check`` lists), its compute
from the model's layer shapes (``bucket_costs``), the machine's rates from
``costmodel.resolve_rates`` (a hardware preset, your own numbers, or a measured compute
profile), and the step from ``costmodel.predict_step``, which plays the schedule of the
passes, of a compile without them, and of torch's ``fully_shard`` on a two-lane machine.
A prediction for comparing plans and machines, not a measurement. Pure: the model stays on
meta, nothing is allocated and no process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from ..config.plan import auto_plan_info
from ..config.schema import OverlapConfig
from ..contract import BucketIndex
from ..report import costmodel
from ..shard.activation_checkpointing import checkpointed_modules
from .analysis import _add_bytes, _memory, bucket_rows, kept_for_backward, parameter_buckets

__all__ = [
    "ADAMW_BYTES_PER_PARAM",
    "DEFAULT_SEQ",
    "DEPTHS",
    "GROUPINGS",
    "TIE",
    "TIE_RULE",
    "bucket_costs",
    "choose",
    "plan_yaml",
    "predict_plan",
    "suggest",
]

#: Bytes AdamW reads and writes per parameter of the rank's shard in its step, all fp32:
#: reads the parameter, its gradient and both moments (16), writes the parameter and both
#: moments (12). The step is memory-bound, so it takes these bytes at the memory rate.
ADAMW_BYTES_PER_PARAM = 28

#: Tokens per sequence a prediction assumes without --seq (fewer when the model takes fewer:
#: ``models.sequence_length``).
DEFAULT_SEQ = 2048

#: Repeated blocks per bucket that ``suggest`` tries (the last bucket of a run may hold fewer).
GROUPINGS = (1, 2, 3, 4, 6, 8)
#: Prefetch depths ``suggest`` tries with each plan.
DEPTHS = (1, 2, 3)
#: Steps within this fraction of the fastest are a tie for ``suggest``: the cost model is
#: not finer than that, so a tie goes to the candidate holding less memory (``TIE_RULE``).
TIE = 0.01
#: ``suggest``'s choice among the candidates that fit the budget, in the words its footer
#: and docs/tuning.md print; ``choose`` is the same rule as code.
TIE_RULE = (
    f"steps within {TIE:.0%} of the fastest count as equal; of those, the one gathering the least parameter "
    "memory ahead wins, then the faster, then the auto plan, then the settings now"
)

#: Where a bucket for the parameters no plan entry holds is named (they are gathered apart
#: from the buckets, at the root module's turn).
ROOT_NAME = "parameters no bucket holds"

# Attention modules name the projection that makes their queries one of these ways
# (models.gpt and transformers' families); the number is how many widths its output
# holds (q, k and v fused: 3).
_QUERY_PROJECTIONS = (("q_proj", 1), ("query", 1), ("wq", 1), ("qkv", 3), ("c_attn", 3), ("query_key_value", 3))


def _matmul_size(module: nn.Module) -> int:
    """in x out of a module that multiplies its input by a weight matrix: ``nn.Linear``,
    and transformers' ``Conv1D`` (GPT-2's Linear, weight stored transposed); 0 otherwise."""
    if isinstance(module, nn.Linear):
        return module.in_features * module.out_features
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and weight is not None and weight.dim() == 2:
        return weight.numel()
    return 0


def _out_width(module: nn.Module) -> int:
    if isinstance(module, nn.Linear):
        return module.out_features
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and weight is not None and weight.dim() == 2:
        return int(weight.shape[1])
    return 0


def _query_projection(module: nn.Module) -> tuple[str, int] | None:
    """(attribute, query width) of the projection making ``module``'s queries, if it has one."""
    for attr, parts in _QUERY_PROJECTIONS:
        sub = getattr(module, attr, None)
        if isinstance(sub, nn.Module) and _out_width(sub):
            return attr, _out_width(sub) // parts
    return None


def _attention(fqn: str, module: nn.Module) -> tuple[int, str] | None:
    """(query width, FQN of its query projection) when ``module`` is an attention module:
    one with q_proj, k_proj and v_proj, or whose class name ends with "Attention" (models.gpt's
    ``Attention``, transformers' ``LlamaAttention``, ``GPT2Attention``, ...), its width read from
    the projection making its queries (searched below it when it holds none itself)."""
    has_qkv = all(isinstance(getattr(module, a, None), nn.Module) for a in ("q_proj", "k_proj", "v_proj"))
    if not has_qkv and not type(module).__name__.endswith("Attention"):
        return None
    for name, sub in module.named_modules():
        found = _query_projection(sub)
        if found:
            where = ".".join(p for p in (fqn, name, found[0]) if p)
            return found[1], where
    return None


def _forward_flops(model: nn.Module, index: BucketIndex, *, batch: int, seq: int, root: int) -> dict[int, list]:
    """Per plan index (``root``: no entry), the forward FLOPs of the modules whose forward
    runs there, and which of them are checkpointable: ``{i: [(fqn, flops), ...]}``."""
    tokens = batch * seq
    out: dict[int, list] = {}
    inside_attention: list[str] = []
    for fqn, module in model.named_modules():
        size = _matmul_size(module)
        if size:
            bucket = index.bucket_of(fqn)
            out.setdefault(root if bucket is None else bucket, []).append((fqn, 2 * tokens * size))
        if any(fqn == a or fqn.startswith(a + ".") for a in inside_attention):
            continue  # an attention module's own sub-modules are not counted again
        found = _attention(fqn, module)
        if found:
            width, projection = found
            inside_attention.append(fqn)
            bucket = index.bucket_of(fqn)
            bucket = index.bucket_of(projection) if bucket is None else bucket
            out.setdefault(root if bucket is None else bucket, []).append((fqn, 4 * batch * seq * seq * width))
    return out


def bucket_costs(
    model: nn.Module, config: OverlapConfig, plan: list[list[str]], *, batch: int, seq: int
) -> list[dict[str, Any]]:
    """One dict per bucket of ``plan`` (module-FQN lists, as ``check`` resolves them), in
    the form ``costmodel.plan_schedule`` takes, plus a last bucket named "parameters no
    bucket holds" where some parameter belongs to no entry (gathered apart, one by one).

    * ``gather_bytes`` / ``reduce_bytes``: ``analysis.bucket_rows`` (in param_dtype /
      reduce_dtype; a tied parameter once, in the bucket of its first registration);
    * ``collectives``: its parameters (the collectives a compile without the passes issues);
    * ``flops_forward``: one rank's, for its ``batch`` x ``seq`` tokens, counted as
      ``passes/events.py`` counts a traced graph: 2 x tokens x in x out for every
      ``nn.Linear`` (or transformers ``Conv1D``) whose module is in the bucket (in its
      subtrees but not in a nested entry; a tied head counts where its module is), and
      4 x batch x seq^2 x width for every attention module (width: its queries' width,
      heads x head dim; full, not halved for a causal mask, as the graph's attention op is
      counted). Embeddings, norms, activations and the loss count nothing: elementwise work
      is small beside the matmuls of a model worth sharding. A mixture of experts counts
      every expert held as a Linear, as if each ran on every token;
    * ``flops_backward``: 2 x forward (a gradient for the input and one for the weight per
      matmul), plus the forward again for modules under ``activation_checkpointing`` with
      the "full" policy (``recompute_flops``: recomputed in backward; "matmuls_saved"
      keeps the matmul and attention outputs, so recomputes none of these FLOPs);
    * ``regather``: gathered again in backward, i.e. the forward resharded it: False for
      the last buckets the reshard pass keeps (``analysis.kept_for_backward``, the rule
      ``check``'s memory lines use) and for all with ``reshard_after_forward: false``.

    Also ``index``, ``name`` (its modules, as ``check`` lists them), ``modules``, ``params``
    (elements)."""
    rows = bucket_rows(model, config, plan)
    homes = parameter_buckets(model, plan)
    by_id = {id(p): p for p in model.parameters()}
    root = len(plan)
    flops = _forward_flops(model, BucketIndex(plan), batch=batch, seq=seq, root=root)
    checkpointed, _ = checkpointed_modules(model, config)
    recompute = config.activation_checkpointing_policy == "full"

    def recomputed(items: list) -> int:
        if not recompute:
            return 0
        return sum(f for fqn, f in items if any(fqn == c or fqn.startswith(c + ".") for c in checkpointed))

    out = []
    for r in rows:
        i = r["index"]
        items = flops.get(i, [])
        forward = sum(f for _, f in items)
        again = recomputed(items)
        out.append(
            {
                "index": i,
                "name": ", ".join(r["modules"]),
                "modules": list(r["modules"]),
                "params": r["params"],
                "gather_bytes": r["gather_bytes"],
                "reduce_bytes": r["reduce_bytes"],
                "collectives": sum(1 for b in homes.values() if b == i),
                "flops_forward": forward,
                "flops_backward": 2 * forward + again,
                "recompute_flops": again,
            }
        )
    loose = [pid for pid, b in homes.items() if b is None]
    if loose or flops.get(root):
        totals = {"gather_bytes": 0, "reduce_bytes": 0}
        _add_bytes(totals, loose, by_id, config)
        forward = sum(f for _, f in flops.get(root, []))
        again = recomputed(flops.get(root, []))
        out.append(
            {
                "index": root,
                "name": ROOT_NAME,
                "modules": [],
                "params": sum(by_id[pid].numel() for pid in loose),
                **totals,
                "collectives": len(loose),
                "flops_forward": forward,
                "flops_backward": 2 * forward + again,
                "recompute_flops": again,
            }
        )
    return _mark_regather(out, len(plan), config)


def _mark_regather(costs: list[dict], planned: int, config: OverlapConfig) -> list[dict]:
    """Set each bucket's ``regather``: the forward resharded it, so the backward gathers it
    again; not the last buckets the reshard pass keeps gathered (``kept_for_backward``, the
    rule ``check``'s memory lines use), and none with ``reshard_after_forward: false``. The
    bucket of parameters no entry holds (index ``planned``) is resharded like the others."""
    kept = kept_for_backward([c["gather_bytes"] for c in costs[:planned]], config)
    for c in costs:
        c["regather"] = config.reshard_after_forward and (c["index"] >= planned or c["index"] < planned - kept)
    return costs


def _rates(device_type: str | None, config: OverlapConfig, hardware: Any, profile: Any) -> dict[str, Any]:
    return costmodel.resolve_rates(
        device_type,
        config.hardware if hardware is None else hardware,
        config.compute_profile if profile is None else profile,
    )


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _step(
    costs: list[dict], rates: dict, *, schedule: str, depth: int, shard: int, replicas: int, extra: float
) -> dict:
    p = costmodel.predict_step(
        costs, rates, schedule=schedule, depth=depth, shard=shard, replicas=replicas, extra_compute_s=extra
    )
    return {k: p[k] for k in ("step_s", "compute_s", "comm_s", "exposed_comm_s")}


def _setting(
    model: nn.Module, config: OverlapConfig, world: int, replicate: int, device_type: str | None, hardware, profile
) -> tuple[dict[str, Any], int, float]:
    """What every prediction of one model on one machine shares: the resolved rates, the
    shard group's size, and the optimizer step's seconds (AdamW on the rank's shard at the
    memory rate)."""
    resolved = _rates(device_type, config, hardware, profile)
    shard = max(world // max(replicate, 1), 1)
    return resolved, shard, ADAMW_BYTES_PER_PARAM * -(-_params(model) // shard) / resolved["rates"]["mem"]


def predict_plan(
    model: nn.Module,
    config: OverlapConfig,
    plan: list[list[str]],
    *,
    world: int,
    replicate: int = 1,
    batch: int = 1,
    seq: int = DEFAULT_SEQ,
    hardware: Any = None,
    profile: Any = None,
    device_type: str | None = "cuda",
    costs: list[dict] | None = None,
) -> dict[str, Any]:
    """The predicted step per rank of ``plan`` on ``world`` ranks (``replicate`` replicas of
    ``world // replicate`` shards), each rank with ``batch`` sequences of ``seq`` tokens.

    Rates: ``costmodel.resolve_rates(device_type, hardware or config.hardware, profile or
    config.compute_profile)``. The optimizer step runs after the backward, hiding nothing:
    AdamW on the rank's shard, ``ADAMW_BYTES_PER_PARAM`` bytes per parameter at the memory
    rate (``optimizer_s``, in every schedule's ``step_s``; with a measured compute profile
    the memory rate is inside its achieved FLOP/s, so this is about 0).

    Returns, per schedule ("passes" at ``config.prefetch_depth``, "no-passes", "fsdp2"):
    ``step_s``, ``compute_s`` (forward and backward), ``comm_s`` (link busy),
    ``exposed_comm_s`` (compute waiting for it), ``tokens_per_s`` (this rank's); and
    ``rates``, ``sources`` (where each rate comes from), ``preset``, ``own`` (rates you
    gave), ``measured``, the shape (``world``, ``shard``, ``replicate``, ``batch``, ``seq``,
    ``depth``), ``optimizer_s`` and ``buckets`` (``bucket_costs``)."""
    resolved, shard, optimizer_s = _setting(model, config, world, replicate, device_type, hardware, profile)
    rates = resolved["rates"]
    costs = bucket_costs(model, config, plan, batch=batch, seq=seq) if costs is None else costs
    out: dict[str, Any] = {
        "world": world,
        "shard": shard,
        "replicate": replicate,
        "batch": batch,
        "seq": seq,
        "tokens_per_rank": batch * seq,
        "depth": config.prefetch_depth,
        "optimizer_s": optimizer_s,
        "optimizer_bytes_per_param": ADAMW_BYTES_PER_PARAM,
        "rates": rates,
        "sources": resolved["sources"],
        "preset": resolved["preset"],
        "own": resolved["own"],
        "measured": resolved["measured"],
    }
    for schedule in costmodel.SCHEDULES:
        step = _step(
            costs,
            rates,
            schedule=schedule,
            depth=config.prefetch_depth,
            shard=shard,
            replicas=replicate,
            extra=optimizer_s,
        )
        step["tokens_per_s"] = batch * seq / step["step_s"] if step["step_s"] > 0 else None
        out[schedule] = step
    out["buckets"] = costs
    return out


# ------------------------------------------------------------------------------ suggest
@dataclass
class _Plan:
    """One bucket plan ``suggest`` tries: its words, its buckets, and what to paste for it."""

    words: str
    buckets: list[list[str]]
    auto: bool = False
    per_bucket: int | None = None
    """Repeated blocks per bucket (None: not a grouping of blocks)."""
    current: bool = False


def _candidate_plans(model: nn.Module, config: OverlapConfig, current: list[list[str]]) -> list[_Plan]:
    """The auto plan, the auto plan with ``k`` consecutive repeated blocks per bucket (each
    ``k`` of ``GROUPINGS`` up to the number of blocks; the modules before and after the
    blocks bucketed as auto does), and the plan the config resolves to now where it is none
    of these. Identical plans appear once, under the first name."""
    auto = auto_plan_info(model, config)
    plans = [_Plan("auto" + (" (one block per bucket)" if auto.blocks else ""), auto.buckets, auto=True)]
    blocks = auto.blocks
    if blocks:
        first = auto.buckets.index([blocks[0]])
        last = auto.buckets.index([blocks[-1]])
        before, after = auto.buckets[:first], auto.buckets[last + 1 :]
        for k in GROUPINGS:
            if k == 1 or k > len(blocks):
                continue
            grouped = [blocks[i : i + k] for i in range(0, len(blocks), k)]
            rest = len(blocks) % k
            words = f"{k} blocks per bucket" + (f" (the last {rest})" if rest else "")
            plans.append(_Plan(words, before + grouped + after, per_bucket=k))
    for p in plans:
        if p.buckets == current:
            p.current = True
            break
    else:
        plans.append(_Plan("your bucket_plans", current, current=True))
    return plans


def plan_yaml(buckets: list[list[str]] | str, depth: int, key=lambda name: name) -> str:
    """The plugin-config lines that select ``buckets`` (a list of module lists, or "auto")
    and ``depth``; ``key`` spells a key as the user's file does."""
    lines = []
    if buckets == "auto":
        lines.append(f"{key('bucket_plans')}: auto")
    else:
        lines.append(f"{key('bucket_plans')}:")
        lines += [f"  - [{', '.join(bucket)}]" for bucket in buckets]
    lines.append(f"{key('prefetch_depth')}: {depth}")
    return "\n".join(lines) + "\n"


def choose(candidates: list[dict[str, Any]]) -> int | None:
    """The index of ``suggest``'s pick among ``candidates`` (each with ``step_s``,
    ``peak_bytes``, ``fits``, ``auto``, ``current``), by ``TIE_RULE``: of those that fit,
    the ones within ``TIE`` of the fastest step tie, and the least memory gathered ahead
    wins, then the faster, then the auto plan, then the settings now. None when none fits."""
    fitting = [i for i, c in enumerate(candidates) if c["fits"]]
    if not fitting:
        return None
    best = min(candidates[i]["step_s"] for i in fitting)
    tied = [i for i in fitting if candidates[i]["step_s"] <= best * (1 + TIE)]
    return min(
        tied,
        key=lambda i: (
            candidates[i]["peak_bytes"],
            candidates[i]["step_s"],
            not candidates[i]["auto"],
            not candidates[i]["current"],
        ),
    )


def suggest(
    model: nn.Module,
    config: OverlapConfig,
    current: list[list[str]],
    *,
    world: int,
    replicate: int = 1,
    batch: int = 1,
    seq: int = DEFAULT_SEQ,
    hardware: Any = None,
    profile: Any = None,
    device_type: str | None = "cuda",
    budget: int | None = None,
) -> dict[str, Any]:
    """The bucket plan and prefetch depth with the fastest predicted step (schedule
    "passes") whose gathered-ahead peak fits ``budget`` (bytes; None: any).

    Tries each of ``_candidate_plans`` at each of ``DEPTHS`` (and the config's own depth).
    The peak is the one ``check`` prints: the most parameter bytes gathered at once while
    prefetching, forward or backward (``analysis._memory``, the pass's own rule). The choice
    follows ``TIE_RULE`` (``choose``): among the candidates within ``TIE`` of the fastest,
    the smallest peak wins, then the faster, then the auto plan, then the current settings.

    Returns ``candidates`` (each: ``words``, ``buckets`` (count), ``plan`` ("auto" or the
    module lists, as the config takes it), ``modules`` (the module lists), ``per_bucket``
    (repeated blocks per bucket; None for auto and your own plan), ``depth``, ``step_s``, ``exposed_comm_s``, ``comm_s``, ``compute_s``, ``peak_bytes``,
    ``fits``, ``auto``, ``current``), ``chosen`` and ``current`` (indices into them, chosen
    None when nothing fits), ``speedup`` (current step / chosen step) and the rates as
    ``predict_plan`` gives them."""
    resolved, shard, optimizer_s = _setting(model, config, world, replicate, device_type, hardware, profile)
    rates = resolved["rates"]
    depths = sorted(set(DEPTHS) | {config.prefetch_depth})
    at_depth = {d: config if d == config.prefetch_depth else config.replace(prefetch_depth=d) for d in depths}
    candidates: list[dict[str, Any]] = []
    for p in _candidate_plans(model, config, current):
        costs = bucket_costs(model, config, p.buckets, batch=batch, seq=seq)
        sizes = [c["gather_bytes"] for c in costs[: len(p.buckets)]]
        for d in depths:
            if d not in DEPTHS and not p.current:
                continue
            cfg = at_depth[d]
            _mark_regather(costs, len(p.buckets), cfg)  # the kept buckets follow the depth
            step = _step(costs, rates, schedule="passes", depth=d, shard=shard, replicas=replicate, extra=optimizer_s)
            peak = _memory(model, sizes, None, None, cfg)["prefetch_peak_bytes"]
            candidates.append(
                {
                    "words": p.words,
                    "buckets": len(costs),
                    "plan": "auto" if p.auto else [list(b) for b in p.buckets],
                    "modules": [list(b) for b in p.buckets],
                    "per_bucket": p.per_bucket,
                    "depth": d,
                    **step,
                    "tokens_per_s": batch * seq / step["step_s"] if step["step_s"] > 0 else None,
                    "peak_bytes": peak,
                    "fits": budget is None or peak <= budget,
                    "auto": p.auto,
                    "current": p.current and d == config.prefetch_depth,
                }
            )
    now = next(i for i, c in enumerate(candidates) if c["current"])
    chosen = choose(candidates)
    speedup = candidates[now]["step_s"] / candidates[chosen]["step_s"] if chosen is not None else None
    return {
        "world": world,
        "shard": shard,
        "replicate": replicate,
        "batch": batch,
        "seq": seq,
        "tokens_per_rank": batch * seq,
        "budget": budget,
        "tie": TIE,
        "tie_rule": TIE_RULE,
        "optimizer_s": optimizer_s,
        "optimizer_bytes_per_param": ADAMW_BYTES_PER_PARAM,
        "rates": rates,
        "sources": resolved["sources"],
        "preset": resolved["preset"],
        "own": resolved["own"],
        "measured": resolved["measured"],
        "candidates": candidates,
        "chosen": chosen,
        "current": now,
        "speedup": speedup,
    }
