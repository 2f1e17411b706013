"""Text for people: sizes, counts, tables, and the lines ``inspect``, ``check`` and ``suggest`` print."""

from __future__ import annotations

from typing import Any

import torch

from ..config.parse import dtype_name, format_bytes
from ..config.schema import OverlapConfig, prefetch_words

__all__ = [
    "auto_lines",
    "bucket_lines",
    "dtype_lines",
    "format_bytes",
    "format_count",
    "format_flops",
    "format_rate",
    "format_seconds",
    "memory_lines",
    "prediction_lines",
    "reduce_scatter_lines",
    "model_lines",
    "plural",
    "rate_lines",
    "suggest_lines",
    "table",
    "tied_lines",
    "tree_lines",
    "warning_lines",
]


def format_count(n: int) -> str:
    """``207232`` -> ``"207.2K"``; exact below 10,000."""
    if n < 10_000:
        return f"{n:,}"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_flops(n: int | float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} FLOP"


def table(rows: list[list[str]], right: set[int] = frozenset(), indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        out.append((indent + "  ".join(cells)).rstrip())
    return out


def _dtype_label(dtype: torch.dtype | None, key: str, value: str | None, storage: list[str]) -> str:
    shown = dtype_name(dtype) if dtype is not None else "/".join(storage)
    if value is None:
        fallback = "param_dtype" if key == "reduce_dtype" and dtype is not None else "parameter dtype"
        return f"{shown} ({key}: null = {fallback})"
    return f"{shown} ({key}: {value})"


def model_lines(info: dict[str, Any]) -> list[str]:
    where = (
        "on meta, no memory allocated for weights"
        if not info["non_meta_params"]
        else f"{info['non_meta_params']} parameters NOT on meta (the factory placed them on a device)"
    )
    lines = [f"model   {info['spec']} -> {info['class']} ({where})"]
    if info.get("config"):
        changed = [f"{k}={v}" for k, v in info["kwargs"].items()] + list(info.get("notes") or [])
        lines.append(
            f"        transformers config {info['config']}, model_type {info['model_type']}"
            + (f"; overrides: {', '.join(changed)}" if changed else "")
        )
    lines.append(
        f"        {info['params']:,} parameters ({format_count(info['params'])}), "
        f"{format_bytes(info['storage_bytes'])} in {'/'.join(info['storage_dtypes'])}"
    )
    return lines


def dtype_lines(config: OverlapConfig, info: dict[str, Any]) -> list[str]:
    storage = info["storage_dtypes"]
    gather = _dtype_label(config.torch_param_dtype, "param_dtype", config.param_dtype, storage)
    reduce = _dtype_label(config.torch_reduce_dtype, "reduce_dtype", config.reduce_dtype, storage)
    return [f"bytes   storage {'/'.join(storage)} (parameter dtype) | all-gather {gather} | reduce-scatter {reduce}"]


def _runs(rows: list[dict[str, Any]], name, index, same: tuple[str, ...], expand: bool) -> list[list[dict[str, Any]]]:
    """Consecutive rows that differ only in a trailing block number (``blocks.0``, ``blocks.1``,
    ...) and their bucket index, grouped so a 80-layer model prints one line per run."""
    groups: list[list[dict[str, Any]]] = []
    for r in rows:
        prev = groups[-1][-1] if groups else None
        n, p = name(r), name(prev) if prev else None
        if (
            not expand
            and prev is not None
            and n is not None
            and p is not None
            and all(r[k] == prev[k] for k in same)
            and n.rpartition(".")[0] == p.rpartition(".")[0]
            and n.rpartition(".")[2].isdigit()
            and p.rpartition(".")[2].isdigit()
            and int(n.rpartition(".")[2]) == int(p.rpartition(".")[2]) + 1
            and index(r) is not None
            and index(prev) is not None
            and index(r) == index(prev) + 1
        ):
            groups[-1].append(r)
        else:
            groups.append([r])
    out: list[list[dict[str, Any]]] = []
    for g in groups:  # runs shorter than 4 print row by row
        out.extend([g] if len(g) >= 4 else [[r] for r in g])
    return out


def _run_label(group: list[dict[str, Any]], first: str, last: str) -> str:
    return first if len(group) == 1 else f"{first} .. {last} ({len(group)}x)"


def bucket_lines(rows: list[dict[str, Any]], expand: bool = False) -> list[str]:
    grid = [["bucket", "modules", "params", "storage", "all-gather", "reduce-scatter"]]
    one = lambda r: r["modules"][0] if len(r["modules"]) == 1 else None  # noqa: E731
    same = ("params", "storage_bytes", "gather_bytes", "reduce_bytes", "tied")
    for g in _runs(rows, one, lambda r: r["index"], same, expand):
        r = g[0]
        each = "" if len(g) == 1 else " each"
        grid.append(
            [
                str(r["index"]) if len(g) == 1 else f"{r['index']}-{g[-1]['index']}",
                _run_label(g, ", ".join(r["modules"]), ", ".join(g[-1]["modules"])) + (" (tied)" if r["tied"] else ""),
                f"{r['params']:,}",
                format_bytes(r["storage_bytes"]) + each,
                format_bytes(r["gather_bytes"]) + each,
                format_bytes(r["reduce_bytes"]) + each,
            ]
        )
    return table(grid, right={0, 2, 3, 4, 5})


def tree_lines(tree: list[dict[str, Any]], expand: bool = False) -> list[str]:
    grid = [["module", "type", "params", "storage", "all-gather", "reduce-scatter", "bucket"]]
    name = lambda r: r["fqn"] if r["role"] == "bucket" else None  # noqa: E731
    same = ("type", "depth", "params", "storage_bytes", "gather_bytes", "reduce_bytes", "tied")
    for g in _runs(tree, name, lambda r: r["bucket"], same, expand):
        r = g[0]
        bucket = {"container": "", "unbucketed": "none", "own": "none"}.get(r["role"], str(r["bucket"]))
        each = "" if len(g) == 1 else " each"
        grid.append(
            [
                "  " * r["depth"] + _run_label(g, r["fqn"], g[-1]["fqn"]) + (" (tied)" if r.get("tied") else ""),
                r["type"],
                f"{r['params']:,}",
                format_bytes(r["storage_bytes"]) + each,
                format_bytes(r["gather_bytes"]) + each,
                format_bytes(r["reduce_bytes"]) + each,
                bucket if len(g) == 1 else f"{r['bucket']}-{g[-1]['bucket']}",
            ]
        )
    return table(grid, right={2, 3, 4, 5, 6}, indent="")


def tied_lines(tied: list[dict[str, Any]], where: str = "bucket") -> list[str]:
    """One line per tied parameter: counted once, where it is gathered and reduced."""
    out = []
    for t in tied:
        home = f"bucket {t['bucket']}" if t["bucket"] is not None else "no bucket (it is unbucketed there)"
        out.append(
            f"tied    {' and '.join(t['names'])} {'is' if len(t['names']) == 1 else 'are'} {t['param']} "
            f"({t['params']:,} parameters): counted once, in {home}, where its first use gathers it and its "
            f"summed gradient is reduced; rows marked (tied) hold it but do not count it"
        )
    return out


def memory_lines(result: dict[str, Any], config: OverlapConfig) -> list[str]:
    m = result["memory"]
    out = []
    if m["sharded_storage_bytes_per_rank"] is not None:
        mesh = f"{m['replicate']} x {m['shard_size']}" if m["replicate"] > 1 else str(m["shard_size"])
        out.append(
            f"memory  {m['world']} ranks (mesh {mesh}): {format_bytes(m['sharded_storage_bytes_per_rank'])} of "
            "parameters per rank (sharded)"
        )
    if config.mesh.tensor > 1:
        plan = (
            f"tp_plan with {len(config.tp_plan)} entries" if config.tp_plan else "the model's own tensor-parallel plan"
        )
        out.append(
            f"tensor  mesh.tensor {config.mesh.tensor}: tensor-parallel groups of {config.mesh.tensor} consecutive "
            f"ranks ({plan}); the sizes and predictions here count the data-parallel sharding only, every parameter "
            "whole on each tensor-parallel rank (a split one holds 1/tensor of that), and not the plan's own "
            "collectives (docs/tensor-parallel.md)"
        )
    if config.reshard_after_forward:
        window = "-".join(str(i) for i in m["prefetch_peak_buckets"])
        budget = config.max_prefetch_bytes
        held = len(m["prefetch_peak_buckets"])
        out.append(
            f"{'memory' if not out else '':<8}prefetch ({prefetch_words(config.prefetch_depth, budget, config.memory_order)})"
            f" holds at most {held} "
            f"bucket{'s' if held != 1 else ''} gathered at once: peak "
            f"{format_bytes(m['prefetch_peak_bytes'])} (buckets {window}), unsharded, in param_dtype"
        )
        kept = m["kept_for_backward"]
        if config.prefetch_depth > 1 or budget is not None or len(kept) > 1:
            out.append(
                f"{'':<8}buckets ahead, per bucket as consumed: "
                + "; ".join(f"{k} {' '.join(map(str, d)) or '-'}" for k, d in m["prefetch_depths"].items())
                + (
                    f" (after bucket{'s' if len(kept) != 1 else ''} {'-'.join(map(str, kept))}, kept gathered)"
                    if kept
                    else ""
                )
            )
        if len(kept) > max(config.prefetch_depth, 1):
            out.append(
                f"{'':<8}bucket {kept[0]} stays gathered beyond prefetch_depth: the buckets after it gather "
                f"less than it does, too short a backward to hide its re-gather"
            )
    else:
        out.append(
            f"{'memory' if not out else '':<8}reshard_after_forward is off: after forward every bucket stays "
            f"gathered, {format_bytes(m['all_gathered_bytes'])} unsharded"
        )
    return out


def reduce_scatter_choices(config: OverlapConfig, shard_size: int | None) -> dict[str, list[str]]:
    """Per backend, what ``reduce_scatter_impl`` resolves to (``reduce_scatter_choice``, the
    function ``parallelize`` calls) for ``shard_size`` ranks per shard group: ``{backend:
    [impl, reason]}``; with no world size given, gloo twice (2 ranks per shard group, and
    more). A value the backend rejects at startup is ``["error", why]``."""
    from ..config.schema import OverlapConfigError
    from ..runtime.devices import BACKENDS, reduce_scatter_choice

    out = {}
    for backend in BACKENDS.values():
        sizes = {backend: shard_size or 2}
        if shard_size is None and backend == "gloo":
            sizes = {"gloo (2 ranks per shard group)": 2, "gloo (more ranks)": 4}
        for label, size in sizes.items():
            try:
                out[label] = list(
                    reduce_scatter_choice(config.reduce_scatter_impl, backend, size, compiled=config.compile)
                )
            except OverlapConfigError as error:
                out[label] = ["error", str(error)]
    return out


def reduce_scatter_lines(choices: dict[str, list[str]], config: OverlapConfig) -> list[str]:
    if not config.compile:
        return []
    by_impl: dict[str, list[str]] = {}
    for label, (impl, _) in choices.items():
        by_impl.setdefault(impl, []).append(label)
    said = "; ".join(
        f"{'an error' if impl == 'error' else impl} on {' / '.join(labels)}" for impl, labels in by_impl.items()
    )
    lines = [f"reduce-scatter  reduce_scatter_impl: {config.reduce_scatter_impl} -> {said}"]
    if config.reduce_scatter_impl == "auto":
        lines += [f"{'':<16}{label}: {reason}" for label, (_, reason) in choices.items() if label.startswith("gloo")]
    errors = {reason for impl, reason in choices.values() if impl == "error"}
    lines += [f"{'':<16}{reason}" for reason in sorted(errors)]
    return lines


def warning_lines(result: dict[str, Any]) -> list[str]:
    if not result["warnings"]:
        return ["warnings: none"]
    return [f"warnings ({len(result['warnings'])}):"] + [
        f"  - [{w['kind']}] {w['message']}" for w in result["warnings"]
    ]


def auto_lines(result: dict[str, Any]) -> list[str]:
    auto = result["auto"]
    source = {
        "bucket_bytes": "bucket_bytes",
        "median block": "one block, the median; bucket_bytes: null",
        "default (no repeated blocks)": "no repeated blocks; bucket_bytes: null",
    }[auto["target_source"]]
    blocks = auto["blocks"]
    shown = f"{blocks[0]} .. {blocks[-1]} ({len(blocks)})" if len(blocks) > 2 else ", ".join(blocks)
    head = f"auto plan: {len(auto['buckets'])} buckets"
    head += f"; repeated blocks {shown}, one bucket each" if blocks else "; no repeated blocks"
    head += f"; other modules grouped to {format_bytes(auto['target_bytes'])} ({source})"
    return [head]


# ------------------------------------------------------------------- the predictions
def format_seconds(s: float, like: float | None = None) -> str:
    """``0.4123`` -> ``"0.412 s"``, ``0.0801`` -> ``"80.1 ms"``, ``4.2e-5`` -> ``"42.0 us"``: three
    significant digits, in the unit and with the decimals ``like`` would take, so the figures
    of one line or column read alike (``0.0031, like=0.0778`` -> ``"3.1 ms"``)."""
    ref = s if like is None else like
    unit, scale = ("s", 1.0) if ref >= 0.1 else ("ms", 1e3) if ref >= 1e-3 else ("us", 1e6)
    r = ref * scale
    decimals = 0 if r >= 100 else 1 if r >= 10 else 2 if r >= 1 else 3
    return f"{s * scale:,.{decimals}f} {unit}"


def format_rate(value: float, unit: str) -> str:
    """``3.6e11, "B/s"`` -> ``"360 GB/s"``; ``4.95e14, "FLOP/s"`` -> ``"495 TFLOP/s"``."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def rate_lines(pred: dict[str, Any]) -> list[str]:
    """The rates a prediction used, each with where it comes from (``costmodel.resolve_rates``)."""
    rates, sources = pred["rates"], pred["sources"]
    shown = [
        ("link", f"{format_rate(rates['link'], 'B/s')} per rank between the ranks of a shard group", "link"),
        ("compute", f"{format_rate(rates['flops'], 'FLOP/s')} achieved", "flops"),
        ("memory", format_rate(rates["mem"], "B/s"), "mem"),
        ("latency", f"{format_seconds(rates['latency'])} per collective" if rates["latency"] else "none", "latency"),
    ]
    if pred["replicate"] > 1:
        shown.insert(
            1, ("replicas", f"{format_rate(rates['inter_link'], 'B/s')} per rank between replicas", "inter_link")
        )
    if rates.get("contention") or rates.get("send_first", 1.0) != 1.0:
        host = f"compute {1 + rates.get('contention', 0):g}x slower while the link is busy"
        host += f", send-first collectives (gloo's) x{rates.get('send_first', 1.0):g}"
        shown.append(("host", host, "contention"))
    if pred["measured"] or rates["mem"] >= 1e17:  # memory-bound work is inside a measured compute rate
        shown = [row for row in shown if row[0] != "memory"]
    width = max(len(name) for name, _, _ in shown)
    return [f"    {name + ':':<{width + 1}} {value}; {sources[key]}" for name, value, key in shown]


def _shape_words(pred: dict[str, Any]) -> str:
    mesh = f"{pred['replicate']} x {pred['shard']}" if pred["replicate"] > 1 else str(pred["shard"])
    assumed = " assumed (--world)" if pred.get("world_assumed") else ""
    return f"{pred['world']} ranks{assumed}, mesh {mesh}; {pred['batch']} x {pred['seq']} tokens per rank from --batch/--seq"


def prediction_lines(pred: dict[str, Any], config: OverlapConfig) -> list[str]:
    """The predicted step of ``check`` / ``inspect``: with the passes, without them, and
    torch's ``fully_shard``, then the rates and where each comes from."""
    on, off, fsdp2 = pred["passes"], pred["no-passes"], pred["fsdp2"]
    like = max(on["step_s"], off["step_s"], fsdp2["step_s"])
    sec = lambda s: format_seconds(s, like)  # noqa: E731
    head = (
        f"predicted step per rank (cost model; {_shape_words(pred)}): "
        f"{sec(on['step_s'])} with the passes (communication {sec(on['comm_s'])}, "
        f"{sec(on['exposed_comm_s'])} of it exposed), "
        f"{sec(off['step_s'])} without them ({sec(off['exposed_comm_s'])} exposed), "
        f"{sec(fsdp2['step_s'])} for torch's fully_shard ({sec(fsdp2['exposed_comm_s'])} exposed)"
    )
    lines = [head]
    if on["tokens_per_s"]:
        lines.append(
            f"  {on['tokens_per_s']:,.0f} tokens/s per rank with the passes (prefetch_depth {pred['depth']}); "
            f"compute {format_seconds(on['compute_s'])} forward and backward, optimizer step "
            f"{format_seconds(pred['optimizer_s'])} (AdamW on the rank's shard: {pred['optimizer_bytes_per_param']} "
            "bytes per parameter at the memory rate)"
        )
    if not config.compile:
        lines.append("  compile: false runs torch's fully_shard per bucket: its figure is the one for this config")
    lines.append(
        "  rates (--hardware, --profile; a prediction, not a measurement: docs/performance.md says how good it is):"
    )
    return lines + rate_lines(pred)


def suggest_lines(result: dict[str, Any], snippet: str, where: str = "") -> list[str]:
    """``suggest``'s table, its choice, and the config lines that select it."""
    cands = result["candidates"]
    chosen, now = result["chosen"], result["current"]
    budget = result["budget"]
    grid = [["", "plan", "buckets", "ahead", "step", "exposed", "gathered-ahead peak"]]
    like = max(c["step_s"] for c in cands)
    for i, c in enumerate(cands):
        grid.append(
            [
                " ".join(w for w, on in (("*", i == chosen), ("now", c["current"])) if on),
                c["words"],
                str(c["buckets"]),
                str(c["depth"]),
                format_seconds(c["step_s"], like),
                format_seconds(c["exposed_comm_s"], like),
                format_bytes(c["peak_bytes"]) + ("" if c["fits"] else " (over budget)"),
            ]
        )
    lines = [
        f"predicted step per rank with the passes (cost model; {_shape_words(result)}; memory budget "
        f"{format_bytes(budget) if budget is not None else 'none (--memory-budget)'}); "
        "ahead = prefetch_depth, * = suggested, now = the settings now:"
    ]
    lines += table(grid, right={2, 3, 4, 5, 6})
    current = cands[now]
    settings = f"{current['words']}, prefetch_depth {current['depth']}"
    if chosen is None:
        smallest = min(cands, key=lambda c: c["peak_bytes"])
        lines.append(
            f"nothing fits the memory budget of {format_bytes(budget)}: the smallest gathered-ahead peak is "
            f"{format_bytes(smallest['peak_bytes'])} ({smallest['words']}, prefetch_depth {smallest['depth']}); "
            "raise --memory-budget, or split the largest buckets (fsdp-overlap check lists them)"
        )
    elif chosen == now:
        lines.append(
            f"your settings are already the best of these ({settings}): {format_seconds(current['step_s'])} per "
            "step predicted; nothing to change"
        )
    else:
        c = cands[chosen]
        speedup, now_words = result["speedup"], f"now ({settings}: {format_seconds(current['step_s'])})"
        if speedup >= 1 + result["tie"]:
            than = f"{(speedup - 1) * 100:.1f}% faster than {now_words}"
        elif speedup > 1 - result["tie"]:
            than = f"as fast as {now_words}, within {result['tie'] * 100:.0f}%"
        else:
            than = f"{(1 - speedup) * 100:.1f}% slower than {now_words}, which does not fit the budget"
        lines.append(
            f"suggested: {c['words']}, prefetch_depth {c['depth']}: {format_seconds(c['step_s'])} per step "
            f"predicted, {than}; it gathers up to {format_bytes(c['peak_bytes'])} ahead "
            f"(now {format_bytes(current['peak_bytes'])})"
        )
        lines.append(f"paste into the plugin config{where}:")
        lines += ["  " + line for line in snippet.splitlines()]
    lines.append(f"  ({result['tie_rule']})")
    lines.append(
        "  rates (--hardware, --profile; a prediction, not a measurement: docs/performance.md says how good it is):"
    )
    return lines + rate_lines(result)
