"""Helpers for tests that run the real ``accelerate launch`` command on examples/accelerate_train.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml
from _dist import raise_on_launcher_crash

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "accelerate_train.py"
OVERLAP_YAML = ROOT / "configs" / "overlap.yaml"

# Example settings the core reference run must repeat (see examples/accelerate_train.py).
BATCH_PER_RANK = 4
SEQ = 32
LR = 3e-3
MAX_GRAD_NORM = 1.0
MODEL = dict(n_layer=4, d_model=64, block_size=SEQ)


def launch_env() -> dict[str, str]:
    """The environment of a user's shell: the package importable, one thread per rank, and
    nothing a launcher or an earlier test exported (no CPU override, no config, no rank)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    # PYTHONFAULTHANDLER: a rank killed in native code writes every thread's Python stack
    # to stderr, which _launch shows when the crash fails the test
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    for name in ("ACCELERATE_USE_CPU", "FSDP_OVERLAP_CONFIG", "LOCAL_RANK", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    return env


def _launch(cmd: list[str], cwd: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """``cmd`` (a command that starts ranks through torch's elastic launcher), run once,
    with the native-crash policy of ``_dist.run_ranks``: when it fails because a rank was
    killed by a signal in native code, the test fails at once with faulthandler's stacks
    (``_dist.raise_on_launcher_crash``: ``NativeCrash``, or its own ``AssertionError``
    when the crashing thread ran fsdp_overlap_plugin code), counted, never rerun. Any
    other failure is returned for the test to show."""
    proc = subprocess.run(
        cmd, cwd=cwd, env={**launch_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        text = output(proc)
        raise_on_launcher_crash(
            text,
            f"{' '.join(cmd)} failed ({proc.returncode}); its output ends:\n{text[-6000:]}",
            what=" ".join([Path(cmd[0]).name, *cmd[1:2]]),  # e.g. "accelerate launch"
        )
    return proc


def accelerate_launch(
    config: str | Path,
    *script_args: str,
    script: Path = EXAMPLE,
    timeout: float = 600,
    env: dict | None = None,
    launcher_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file CONFIG --num_processes 2 [LAUNCHER_ARGS] SCRIPT ARGS``
    (by default examples/accelerate_train.py), run from the repository root as a user would,
    once, with ``env`` on top of a user's shell; a native crash of a rank fails the test
    (``_launch``)."""
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [
        str(accelerate),
        "launch",
        "--config_file",
        str(config),
        "--num_processes",
        "2",
        *launcher_args,
        str(script.relative_to(ROOT)),
    ]
    return _launch([*cmd, *script_args], ROOT, timeout, env)


def fsdp_overlap(*argv: str, cwd: Path = ROOT, timeout: float = 600) -> subprocess.CompletedProcess:
    """The ``fsdp-overlap`` console script with ``argv``, from ``cwd``, as a user would run
    it; a native crash of a rank that ``fsdp-overlap launch`` started fails the test at
    once (``_launch``)."""
    command = Path(sys.executable).with_name("fsdp-overlap")
    return _launch([str(command), *argv], cwd, timeout)


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def copy_yaml(path: Path, **fsdp_changes) -> Path:
    """configs/overlap.yaml with some ``fsdp_config`` keys changed, written to ``path``."""
    data = yaml.safe_load(OVERLAP_YAML.read_text())
    data["fsdp_config"].update(fsdp_changes)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def rank_lines(text: str, model: str = "GPT") -> dict[int, tuple[int, int]]:
    """``{rank: (local elements, total elements)}`` from the example's per-rank line. On a
    CPU each rank names its own process (not ``cpu:0`` for every rank): checked here."""
    found = re.findall(
        rf"\[rank (\d+)/2\] (.*), {model} not wrapped, holds (\d+) of (\d+) parameter elements \(DTensor shards\)",
        text,
    )
    where = [w for _, w, _, _ in found]
    assert all(re.fullmatch(r"CPU process \d+|\w+:\d+", w) for w in where), where
    assert len(set(where)) == len(where), f"two ranks on one device or process: {where}"
    return {int(r): (int(local), int(total)) for r, _, local, total in found}


def core_reference(rank: int, world: int, steps: int, backend: str) -> list[float]:
    """examples/accelerate_train.py's training, through the core ``parallelize()`` and plain
    torch calls (no Accelerate): same seed, model, data split, optimizer and clipping."""
    import torch

    import fsdp_overlap_plugin as fo
    from fsdp_overlap_plugin.models import fixed_batches, gpt_small

    torch.manual_seed(0)
    model = fo.parallelize(gpt_small(**MODEL), fo.OverlapConfig(backend=backend))
    two = fixed_batches(2, BATCH_PER_RANK * world, SEQ, model.cfg.vocab_size)
    return core_losses(model, [two[step % 2] for step in range(steps)], rank, world, BATCH_PER_RANK, LR, MAX_GRAD_NORM)


def core_losses(
    model,
    batches: list,
    rank: int,
    world: int,
    batch_per_rank: int,
    lr: float,
    max_grad_norm: float,
    loss=None,
) -> list[float]:
    """What Accelerate does for a training step, in plain torch: AdamW on this rank's
    slice of each global batch (a tuple of tensors), gradients clipped; the mean loss over
    ranks per step. ``loss(model, *batch)`` (default: the test GPT's ``x, y`` loss)."""
    import torch
    import torch.distributed as dist

    from fsdp_overlap_plugin.models import loss_fn

    loss = loss or (lambda m, x, y: loss_fn(m(x), y))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    mine = slice(rank * batch_per_rank, (rank + 1) * batch_per_rank)
    losses = []
    for batch in batches:
        value = loss(model, *(t[mine] for t in batch))
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = value.detach().clone()
        dist.all_reduce(value)
        losses.append((value / world).item())
    return losses
