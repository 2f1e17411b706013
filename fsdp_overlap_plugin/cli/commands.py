"""``inspect``, ``check`` and ``suggest``: a model's buckets and bytes, a config checked
against it, the step each predicts, and the bucket plan and prefetch depth predicted fastest.

``check`` reads the config with the runtime's reader for its format (``configs.py``) and
resolves it on the model with ``preflight`` (``analysis.py``), so its verdict is the run's:
exit 2 names the key the run would name, and the config it prints is the one the run
would use."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch.nn as nn

from ..config.parse import dtype_name
from ..config.schema import OverlapConfig, OverlapConfigError
from ..report import costmodel
from ..runtime.state import decide_passes
from .analysis import analyze, bucket_rows, module_tree, tied_parameters
from .configs import SHAPES, LoadedConfig, load_config
from .errors import CliError
from .models import load_model, sequence_length, unaccepted_kwargs
from .predict import DEFAULT_SEQ, plan_yaml, predict_plan, suggest
from .text import (
    auto_lines,
    bucket_lines,
    dtype_lines,
    memory_lines,
    model_lines,
    plural,
    prediction_lines,
    reduce_scatter_choices,
    reduce_scatter_lines,
    suggest_lines,
    tied_lines,
    tree_lines,
    warning_lines,
)

__all__ = ["checked_config", "cmd_check", "cmd_inspect", "cmd_suggest", "plan_target", "predict_device"]

#: The device type whose hardware preset a prediction assumes without --hardware or a
#: ``hardware`` setting on a machine with no accelerator: the CLI plans GPU runs (its preset:
#: h100-nvlink). With an accelerator, its own type (``predict_device``).
PREDICT_DEVICE = "cuda"
#: Ranks per replica a prediction assumes when neither --world nor the config gives a world
#: size: one node of the presets (8 GPUs).
ASSUMED_SHARD = 8

Result = tuple[int, dict[str, Any], list[str]]


def plan_target(model: nn.Module, loaded: LoadedConfig) -> nn.Module:
    """The module the run parallelizes, so the plan is resolved against it: for a
    LightningModule, the one the strategy's ``module`` argument selects (``select_target``,
    the strategy's own choice); any other model as it is."""
    try:
        from lightning.pytorch import LightningModule
    except ImportError:  # pragma: no cover - lightning is a dependency
        return model
    if not isinstance(model, LightningModule):
        return model
    from ..lightning._common import select_target

    try:
        return select_target(model, loaded.module or "auto")[1]
    except OverlapConfigError as exc:  # "module: ...": the strategy's own argument
        raise OverlapConfigError(f"{loaded.path}: {loaded.section}.{exc}") from None


def checked_config(
    loaded: LoadedConfig, model: nn.Module, world: int | None, small_bytes: int
) -> tuple[OverlapConfig, nn.Module, dict[str, Any]]:
    """The config the run would use with ``model`` (a LightningModule: the part of it the
    strategy parallelizes), and the analysis of its plan."""
    target = plan_target(model, loaded)
    config = loaded.resolve(target)
    result = analyze(target, config, world=world, small_bytes=small_bytes, key=loaded.key, rename=loaded.rename)
    return config, target, result


def _rates_args(args: argparse.Namespace) -> None:
    """Check --hardware and --profile before any model is built: a bad value is exit 2 with
    the cost model's own message (it names the valid presets and keys)."""
    try:
        if getattr(args, "hardware", None) is not None:
            costmodel.parse_hardware(args.hardware)
        if getattr(args, "profile", None) is not None:
            costmodel.load_profile(args.profile)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def predict_device(hardware: Any) -> tuple[str, str | None]:
    """The device type whose preset a prediction assumes, and a line when that is not the
    preset a run on this machine reports with. The machine's accelerator, as the runtime
    picks it (``runtime.devices.detect_device_type``: a run's report assumes its preset), so
    on a GPU or NPU machine ``check`` and the run agree; on a machine with none,
    ``PREDICT_DEVICE`` (the CLI plans a GPU run; a run here would use the cpu preset, and the
    line says so and how to predict that). ``hardware``: --hardware, else the config's."""
    from ..runtime.devices import detect_device_type

    here = detect_device_type()
    if here != "cpu":
        return here, None
    if hardware:
        return PREDICT_DEVICE, None
    planned, local = costmodel.resolve_rates(PREDICT_DEVICE)["preset"], costmodel.resolve_rates("cpu")["preset"]
    return PREDICT_DEVICE, (
        f"rates   no --hardware and no hardware setting: predicting a GPU run with the {PREDICT_DEVICE} default "
        f"{planned}; this machine has no GPU, and a run on it reports with the cpu default {local} "
        f"(--hardware {local} predicts that; --hardware names the machine you will run on)"
    )


def _seq(args: argparse.Namespace, model: nn.Module, spec: str) -> tuple[int | None, str | None]:
    """--seq checked against the model's longest sequence, or the default cut to it
    (``models.sequence_length``); (None, None) where the caller has no --seq (``launch``)."""
    if not hasattr(args, "seq"):
        return None, None
    return sequence_length(args.seq, model, spec, DEFAULT_SEQ)


def _world(config: OverlapConfig, world: int | None) -> tuple[int, int, bool]:
    """(world, replicas, assumed) for a prediction: the world size given (--world, or the
    one the config file implies), else ``ASSUMED_SHARD`` ranks per replica (assumed)."""
    replicate = config.mesh.replicate
    if world is not None:
        return world, config.mesh.sizes(world)[0], False
    shard = config.mesh.shard if config.mesh.shard != -1 else ASSUMED_SHARD
    return replicate * shard, replicate, True


def _prediction(
    args: argparse.Namespace,
    model: nn.Module,
    config: OverlapConfig,
    plan: list[list[str]],
    world: int | None,
    seq: tuple[int | None, str | None],
) -> tuple[dict[str, Any] | None, list[str]]:
    """The predicted step of ``plan`` and its lines; (None, []) where the caller has no
    --seq (``launch`` runs ``check`` for its verdict only). ``seq``: ``_seq``'s."""
    tokens, seq_note = seq
    if tokens is None:
        return None, []
    world, replicate, assumed = _world(config, world)
    device_type, rates_note = predict_device(args.hardware or config.hardware)
    try:
        pred = predict_plan(
            model,
            config,
            plan,
            world=world,
            replicate=replicate,
            batch=args.batch,
            seq=tokens,
            hardware=args.hardware,
            profile=args.profile,
            device_type=device_type,
        )
    except ValueError as exc:  # the config's own hardware / compute_profile, read again
        raise CliError(str(exc)) from None
    pred.update(world_assumed=assumed, seq_note=seq_note, rates_note=rates_note)
    return pred, [n for n in (seq_note,) if n] + prediction_lines(pred, config) + [n for n in (rates_note,) if n]


def cmd_inspect(args: argparse.Namespace) -> Result:
    _rates_args(args)
    loaded = load_config(args.config)
    model, info = load_model(args.model, args.model_arg)
    seq = _seq(args, model, args.model)
    config, target, result = checked_config(loaded, model, args.world or loaded.world, args.small_bytes)
    plan = [r["modules"] for r in result["plan"]["buckets"]]
    tree = module_tree(target, config, plan, depth=args.depth)
    auto_rows = bucket_rows(target, config, result["auto"]["buckets"])
    auto_tied = tied_parameters(target, result["auto"]["buckets"])
    out = {
        "command": "inspect",
        "model": info,
        "config": {"path": loaded.path, "shape": loaded.shape, "values": config.to_dict(), "notes": loaded.notes},
        "dtypes": {
            "storage": info["storage_dtypes"],
            "gather": dtype_name(config.torch_param_dtype),
            "reduce": dtype_name(config.torch_reduce_dtype),
        },
        "tree": tree,
        "tied": result["tied"],
        "auto_plan": dict(result["auto"], buckets=auto_rows, tied=auto_tied),
        "plan": result["plan"],
        "memory": result["memory"],
        "warnings": result["warnings"],
    }
    lines = model_lines(info)
    if loaded.path:
        lines.append(f"config  {loaded.path} ({loaded.shape})" + "".join(f"; {n}" for n in loaded.notes))
    lines += dtype_lines(config, info)
    lines.append("")
    lines += tree_lines(tree, args.expand)
    if result["plan"]["source"] == "config":
        lines += tied_lines(result["tied"])
    lines.append("")
    lines += auto_lines(result)
    lines += bucket_lines(auto_rows, args.expand)
    lines += tied_lines(auto_tied)
    if result["plan"]["source"] == "config":
        lines.append(
            f"the config's own bucket_plans ({len(plan)} buckets) is in the bucket column above; "
            "fsdp-overlap check lists it"
        )
    lines += memory_lines(result, config)
    lines += warning_lines(result)
    out["prediction"], predicted = _prediction(args, target, config, plan, args.world or loaded.world, seq)
    lines += predicted
    return 0, out, lines


def _config_out(loaded: LoadedConfig, config: OverlapConfig) -> dict[str, Any]:
    return {
        "path": loaded.path,
        "shape": loaded.shape,
        "section": loaded.section,
        "values": config.to_dict(),
        "notes": loaded.notes,
    }


def _with_init_args(loaded: LoadedConfig, spec: str, model_args: list[str]) -> list[tuple[list[str], str]]:
    """The ways to call ``--model`` with a LightningCLI YAML's ``model:`` init args, in
    order, each with the line that says what was done: with them first (as LightningCLI
    passes them to the class the script gives it) when ``spec`` takes them all, or may
    (``**kwargs``); without them when it does not take them (or calling it with them fails)."""
    init = loaded.model_init_args or {}
    given = {a.partition("=")[0] for a in model_args}
    shown = ", ".join(f"{k}={v}" for k, v in init.items() if k not in given)
    shown += f"; --model-arg gives {', '.join(sorted(given & set(init)))}" if given & set(init) else ""
    missing = unaccepted_kwargs(spec, list(init))
    with_them = [f"{k}={json.dumps(v)}" for k, v in init.items() if k not in given] + model_args
    used = (with_them, f"model from --model {spec} with the YAML's model: init args ({shown})")

    def unused(why: str) -> tuple[list[str], str]:
        return model_args, (
            f"the YAML's model: init args ({shown}) are not passed to --model {spec}: {why} (they are for the "
            "LightningModule the script gives LightningCLI; name that class with --model to use them)"
        )

    if missing == []:
        return [used]
    if missing:
        return [unused(f"it takes no {', '.join(missing)}")]
    return [used, unused("calling it with them failed")]


def cmd_check(args: argparse.Namespace) -> Result:
    """``args``: the ``check`` arguments; ``args.environ`` (optional, ``launch`` sets it) is
    what ``accelerate launch`` exports beside the file (see ``configs.load_config``)."""
    _rates_args(args)
    loaded = load_config(args.config, environ=getattr(args, "environ", None))
    where = f", keys under {loaded.section}" + (f" as {loaded.prefix}<key>" if loaded.prefix else "")
    lines = [f"config  {loaded.path} ({SHAPES[loaded.shape]}{where if loaded.section else ''}): keys valid"]
    lines += [f"        {n}" for n in loaded.notes]
    spec, model_args = args.model, list(args.model_arg or [])
    if spec is None and loaded.model_spec is not None:
        spec = loaded.model_spec
        model_args = [f"{k}={json.dumps(v)}" for k, v in loaded.model_kwargs.items()] + model_args
        lines.append(f"        model from model.class_path: {spec}")
    tries = [(model_args, None)]
    if spec is not None and args.model is not None and loaded.model_init_args:
        tries = _with_init_args(loaded, spec, model_args)
    if spec is None:
        out = {"command": "check", "ok": True, "config": _config_out(loaded, loaded.config), "warnings": []}
        out["model"] = None
        if loaded.model_init_args is not None:
            out["needs"] = "--model"
            lines.append(
                f"model   {loaded.path} has `model:` init args but no class_path (LightningCLI takes the class "
                "from the script: LightningCLI(YourModule)); pass --model package.module:YourModule, the class "
                "your script gives LightningCLI, to check the plan against it (the YAML's model: values are "
                "passed to it)"
            )
        else:
            lines.append("model   plan not checked against a model (pass --model pkg.mod:factory to check it)")
        lines += warning_lines(out)
        return 0, out, lines
    for n, (model_args, note) in enumerate(tries):
        try:
            model, info = load_model(spec, model_args)
        except CliError:
            if n + 1 == len(tries):
                raise
            continue
        if note:
            lines.append(f"        {note}")
        break
    seq = _seq(args, model, spec)
    config, target, result = checked_config(loaded, model, args.world or loaded.world, args.small_bytes)
    out = {
        "command": "check",
        "ok": True,
        "config": _config_out(loaded, config),
        "model": info,
        "plan": result["plan"],
        "auto_plan": result["auto"],
        "activation_checkpointing": result["activation_checkpointing"],
        "unbucketed": result["unbucketed"],
        "tied": result["tied"],
        "memory": result["memory"],
        "reduce_scatter": reduce_scatter_choices(config, result["memory"]["shard_size"]),
        "warnings": result["warnings"],
    }
    lines += model_lines(info) + dtype_lines(config, info)
    rows = result["plan"]["buckets"]
    if result["plan"]["source"] == "auto":
        lines += auto_lines(result)
    else:
        lines.append(f"plan    {len(rows)} buckets from {loaded.key('bucket_plans')}")
    lines += bucket_lines(rows, args.expand)
    lines += tied_lines(result["tied"])
    if result["activation_checkpointing"]:
        lines.append(
            f"activation checkpointing ({config.activation_checkpointing_policy}): "
            f"{', '.join(result['activation_checkpointing'])}"
        )
    lines += memory_lines(result, config)
    lines += reduce_scatter_lines(out["reduce_scatter"], config)
    lines += warning_lines(result)
    passes = decide_passes(config).names  # the decision parallelize makes, not a copy of it
    lines.append(
        f"OK: {len(rows)} buckets, {plural(len(result['warnings']), 'warning')}; "
        + (
            f"passes on: {', '.join(passes) or 'none'}"
            if config.compile
            else "compile: false (eager fully_shard per bucket)"
        )
    )
    plan = [r["modules"] for r in rows]
    out["prediction"], predicted = _prediction(args, target, config, plan, args.world or loaded.world, seq)
    lines += predicted
    return (1 if args.strict and result["warnings"] else 0), out, lines


def cmd_suggest(args: argparse.Namespace) -> Result:
    """The bucket plan and prefetch depth predicted fastest for the model on the machine
    (``predict.suggest``), with the config lines that select them. Exit 1 when no candidate
    fits --memory-budget."""
    _rates_args(args)
    loaded = load_config(args.config)
    model, info = load_model(args.model, args.model_arg)
    tokens, seq_note = _seq(args, model, args.model)
    world_given = args.world or loaded.world
    config, target, result = checked_config(loaded, model, world_given, 0)
    world, replicate, assumed = _world(config, world_given)
    current = [r["modules"] for r in result["plan"]["buckets"]]
    device_type, rates_note = predict_device(args.hardware or config.hardware)
    try:
        found = suggest(
            target,
            config,
            current,
            world=world,
            replicate=replicate,
            batch=args.batch,
            seq=tokens,
            hardware=args.hardware,
            profile=args.profile,
            device_type=device_type,
            budget=args.memory_budget,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    found.update(world_assumed=assumed, seq_note=seq_note, rates_note=rates_note)
    chosen = found["chosen"]
    spell = (lambda name: loaded.key(name).rpartition(".")[2]) if loaded.section else (lambda name: name)
    snippet = None
    if chosen is not None:
        snippet = plan_yaml(found["candidates"][chosen]["plan"], found["candidates"][chosen]["depth"], spell)
    where = f" (under {loaded.section} in {loaded.path})" if loaded.section else ""
    out = {
        "command": "suggest",
        "ok": chosen is not None,
        "model": info,
        "config": _config_out(loaded, config),
        **found,
        "yaml": snippet,
    }
    lines = model_lines(info) + dtype_lines(config, info)
    if loaded.path:
        lines.append(f"config  {loaded.path} ({SHAPES[loaded.shape]}): the settings now")
    if not config.compile:
        lines.append(
            "note    compile: false runs torch's fully_shard per bucket, without the passes: these predictions are "
            "for compile: true, and prefetch_depth does not apply until then"
        )
    lines += [seq_note] if seq_note else []
    lines += suggest_lines(found, snippet or "", where)
    lines += [rates_note] if rates_note else []
    return (0 if chosen is not None else 1), out, lines
