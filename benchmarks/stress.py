"""Stress runner: many fresh 2-rank trainings per config variant, counting native deaths.

Each run starts two new processes (gloo, one thread each, the same TCP store rules as
torchrun) that train a tied transformers Llama for a few steps with gradient clipping,
then exit. A run ends one of these ways, counted per variant:

* ``ok``      both ranks exited 0, and the run's final loss (printed by rank 0) is the
              same, bit for bit, as every other ok run of that variant: the training is
              deterministic on CPU, so a second value means a buffer was corrupted
              silently (reported as ``losses: k distinct`` and saved);
* ``native``  a rank died in native code (SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE), or
              memcheck reported an invalid access: a native death;
* ``failed``  a rank exited non-zero (a Python exception) or was killed by another
              signal (SIGKILL from the kernel's OOM killer, SIGTERM);
* ``hang``    the run passed ``--timeout`` and was killed.

Every run that did not end ``ok`` keeps its directory under ``--out``: each rank's
output, faulthandler's stacks of every thread (``-X faulthandler``), and with
``--cores`` its core file and gdb's native backtrace of every thread.

Raising the odds of catching a heap corruption where it happens, not later:

* ``--malloc-check``: glibc's checking allocator (``libc_malloc_debug.so`` preloaded,
  ``glibc.malloc.check=3``, glibc >= 2.34), which aborts at the first inconsistent free;
* ``--perturb N``: glibc fills every freed block with byte ``N`` and every new one with
  its complement (``glibc.malloc.perturb``), so a read of freed memory sees garbage;
* ``--valgrind``: every rank under valgrind's memcheck, Python objects allocated with
  malloc (``PYTHONMALLOC=malloc``) so that memcheck sees them, and scalar kernels for a
  baseline x86-64 (``ATEN_CPU_CAPABILITY=default``, ``TORCHINDUCTOR_CPP_MARCH=x86-64-v2``:
  valgrind could not translate inductor's large AVX kernels, and valgrind 3.19 has no
  AVX-512, which ``g++ -march=native`` emits; with both, a 2-step run has not yet been
  seen to finish here). A first run of each variant outside valgrind fills inductor's cache, so that
  the memcheck runs load compiled code (slow all the same: use ``--steps 2``). Its logs are kept for every run; an invalid read, write or
  free it reports (outside the dynamic loader, whose string compares read past short
  blocks) counts the run as ``native`` and is printed.

Usage::

    python benchmarks/stress.py --variants default:200,native_rs:50 --malloc-check --perturb 165
    python benchmarks/stress.py --variants lightning:20 --cores --out /tmp/stress
    python benchmarks/stress.py --list

Results: a table per variant and ``--json FILE``. ``VARIANTS`` names what each trains.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# variant -> (what it runs, the plugin config it trains with, the compile backend)
VARIANTS: dict[str, tuple[str, dict, str]] = {
    "default": ("loop", {}, "inductor"),  # on gloo with 2 ranks: reduce_scatter_impl receive_first
    "native_rs": ("loop", {"reduce_scatter_impl": "native"}, "inductor"),
    "all_to_all": ("loop", {"reduce_scatter_impl": "all_to_all"}, "inductor"),
    "no_bucketing": ("loop", {"manual_bucketing": False}, "inductor"),
    "passes_off": ("loop", {"manual_bucketing": False, "overlap_grad_reduce": False}, "inductor"),
    "no_compile": ("loop", {"compile": False}, "inductor"),
    "aot_eager": ("loop", {}, "aot_eager"),
    "lightning": ("lightning", {}, "inductor"),
}
# the signals a process dies of in native code (a fault, or glibc's abort on a bad heap)
NATIVE_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE)
MAX_GRAD_NORM = 0.1
BATCH_PER_RANK = 2
SEQ = 16


# ----------------------------------------------------------------------------- one rank
def _llama():
    from _harness.models import build_llama, llama_config

    # hidden 32, 2 layers, 4 heads / 2 kv heads, MLP 64, vocabulary 97 (odd: shards of 49 and
    # 48 rows), tied head
    config = llama_config(32, 2, 4, 2, 64, 97, 64, tied=True)
    return build_llama(config, seed=0)


def _batches(steps: int, world: int):
    import torch

    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 97, (BATCH_PER_RANK * world, SEQ), generator=g) for _ in range(steps)]


def _loop(variant: str, steps: int) -> float:
    import torch
    import torch.distributed as dist

    import fsdp_overlap_plugin as fo

    _, config, backend = VARIANTS[variant]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _llama()
    fo.parallelize(model, dict(config, backend=backend))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = torch.zeros(())
    for batch in _batches(steps, world):
        mine = batch[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
    dist.destroy_process_group()
    return loss.item()


def _lightning(variant: str, steps: int) -> float:
    """The configuration of the crash this runner was written for: a tied Llama under
    ``Trainer(strategy="fsdp_overlap", precision="32-true", gradient_clip_val=0.1)``,
    launched the way torchrun does (Lightning sees TorchElastic's variables)."""
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader

    import fsdp_overlap_plugin  # noqa: F401 (registers strategy="fsdp_overlap")

    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    data = [b[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK] for b in _batches(steps, world)]
    losses: list[torch.Tensor] = []

    class Lit(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _llama()

        def forward(self, ids):
            return self.model(input_ids=ids, labels=ids).loss

        def training_step(self, batch, batch_idx):
            loss = self(batch)
            losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    trainer = Trainer(
        strategy="fsdp_overlap",
        accelerator="cpu",
        devices=world,
        precision="32-true",
        gradient_clip_val=MAX_GRAD_NORM,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Lit(), DataLoader(data, batch_size=None))
    last = trainer.strategy.reduce(losses[-1], reduce_op="mean")
    torch.distributed.destroy_process_group()
    return float(last)


def worker(variant: str, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    runner = _lightning if VARIANTS[variant][0] == "lightning" else _loop
    loss = runner(variant, steps)
    if int(os.environ["RANK"]) == 0:
        print(f"FINAL_LOSS {loss!r}", flush=True)


# ----------------------------------------------------------------------------- the runner
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _malloc_env(check: bool, perturb: int | None) -> dict[str, str]:
    env: dict[str, str] = {}
    tunables = []
    if check:
        debug = sorted(glob.glob("/usr/lib/*/libc_malloc_debug.so*") + glob.glob("/lib*/libc_malloc_debug.so*"))
        if not debug:
            raise SystemExit("--malloc-check: libc_malloc_debug.so not found (glibc >= 2.34 ships it)")
        env["LD_PRELOAD"] = debug[0]
        tunables.append("glibc.malloc.check=3")
    if perturb is not None:
        tunables.append(f"glibc.malloc.perturb={perturb}")
    if tunables:
        env["GLIBC_TUNABLES"] = ":".join(tunables)
    return env


def _backtrace(core: Path) -> str:
    """gdb's native backtrace of every thread in ``core`` (written by a dead rank)."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(gdb not installed)"
    done = subprocess.run(
        [gdb, "-batch", "-nx", "-ex", "thread apply all bt 30", sys.executable, str(core)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.stdout + done.stderr


# memcheck's reports of a real access error (not "uninitialised value" ones, which CPython
# and the dynamic loader produce by the thousand and which cannot corrupt a heap)
_ACCESS = re.compile(r"^==\d+== (Invalid (?:read|write|free)|Mismatched free|Source and destination overlap)")


def _memcheck_errors(log: Path) -> list[str]:
    """Each access error in a memcheck log (up to 16 lines of it), except those raised inside
    the dynamic loader (``dl-*.c``: its SSE string compares read past short blocks)."""
    if not log.exists():
        return []
    errors = []
    lines = log.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        if _ACCESS.match(line):
            block = [line]
            for nxt in lines[i + 1 : i + 16]:
                if re.match(r"^==\d+== ?$", nxt):
                    break  # memcheck ends each report with an empty line
                block.append(nxt)
            stack = [f for f in block[1:] if " at 0x" in f or " by 0x" in f][:4]
            if stack and all("dl-" in f or "ld-linux" in f or "strcmp" in f for f in stack):
                continue
            errors.append("\n".join(block))
    return errors


def classify(codes: list[int], hung: bool, loss: str | None, memcheck: list[str]) -> str:
    """How a run ended (module doc) from its ranks' exit codes (negative: killed by that
    signal), whether it passed the timeout, rank 0's final loss and memcheck's errors."""
    if hung:
        return "hang"
    if any(c < 0 and -c in NATIVE_SIGNALS for c in codes) or memcheck:
        return "native"
    if any(c != 0 for c in codes) or loss is None:
        return "failed"
    return "ok"


def run_once(variant: str, steps: int, workdir: Path, env: dict, timeout: float, valgrind: bool, cores: bool) -> dict:
    """One 2-rank training in fresh processes; how it ended (module doc)."""
    workdir.mkdir(parents=True)
    port = _free_port()
    procs, logs = [], []
    for rank in range(2):
        rank_env = dict(
            os.environ,
            **env,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            GROUP_RANK="0",
            TORCHELASTIC_RUN_ID="stress",
            OMP_NUM_THREADS="1",
            PYTHONFAULTHANDLER="1",
        )
        cmd = [sys.executable, "-X", "faulthandler", __file__, "--worker", variant, "--steps", str(steps)]
        if valgrind:
            cmd = ["valgrind", "--tool=memcheck", "--error-limit=no", f"--log-file={workdir}/valgrind{rank}.txt", *cmd]
            rank_env["PYTHONMALLOC"] = "malloc"  # every Python object a malloc block memcheck sees
        log = open(workdir / f"rank{rank}.txt", "w")  # noqa: SIM115 (closed below)
        preexec = None
        if cores:

            def preexec() -> None:
                import resource

                resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

        procs.append(
            subprocess.Popen(cmd, cwd=workdir, env=rank_env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=preexec)
        )
        logs.append(log)
    start = time.monotonic()
    hung = False
    for p in procs:
        left = max(1.0, timeout - (time.monotonic() - start))
        try:
            p.wait(timeout=left)
        except subprocess.TimeoutExpired:
            hung = True
            for q in procs:
                if q.poll() is None:
                    q.send_signal(signal.SIGABRT if cores else signal.SIGKILL)  # a core shows where it hung
            for q in procs:
                q.wait()
            break
    for log in logs:
        log.close()
    codes = [p.returncode for p in procs]
    seconds = time.monotonic() - start
    out = (workdir / "rank0.txt").read_text(errors="replace")
    loss = next((line.split()[1] for line in out.splitlines() if line.startswith("FINAL_LOSS ")), None)
    memcheck = [e for rank in range(2) for e in _memcheck_errors(workdir / f"valgrind{rank}.txt")] if valgrind else []
    end = classify(codes, hung, loss, memcheck)
    result = {"end": end, "codes": codes, "seconds": round(seconds, 2), "loss": loss, "dir": str(workdir)}
    if valgrind:
        result["memcheck"] = memcheck
    for core in sorted(workdir.glob("core*")):
        (workdir / f"{core.name}.gdb.txt").write_text(_backtrace(core))
    if end != "native" or not cores:
        for core in workdir.glob("core*"):
            if not core.name.endswith(".txt"):
                core.unlink()  # keep the backtraces, not the (large) cores
    return result


def _parse_variants(text: str, runs: int) -> list[tuple[str, int]]:
    chosen = []
    for item in text.split(","):
        name, _, count = item.strip().partition(":")
        if name not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {name!r}; valid: {', '.join(VARIANTS)}")
        chosen.append((name, int(count) if count else runs))
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="default", help="name[:runs],... (runs default: --runs)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--malloc-check", action="store_true")
    parser.add_argument("--perturb", type=int, help="glibc.malloc.perturb byte (1-255)")
    parser.add_argument("--valgrind", action="store_true")
    parser.add_argument("--cores", action="store_true", help="keep core files and gdb backtraces of dead ranks")
    parser.add_argument("--out", help="where failed runs are kept (default: a new temporary directory)")
    parser.add_argument("--keep-all", action="store_true", help="keep the directories of ok runs too")
    parser.add_argument("--json", help="write every run's result here")
    parser.add_argument("--list", action="store_true", help="print the variants and exit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps)
        return 0
    if args.list:
        for name, (kind, config, backend) in VARIANTS.items():
            print(f"{name:14} {kind:9} backend={backend} config={config}")
        return 0
    chosen = _parse_variants(args.variants, args.runs)
    env = _malloc_env(args.malloc_check, args.perturb)
    if args.valgrind:
        # valgrind's translator gives up on inductor's large AVX kernels ("VEX temporary
        # storage exhausted"): scalar kernels, for ATen and for inductor's generated code;
        # and valgrind 3.19 has no AVX-512, which g++ -march=native emits on its own
        # ("unrecognised instruction" in the first kernel): a baseline x86-64 target
        env["ATEN_CPU_CAPABILITY"] = "default"
        env["TORCHINDUCTOR_CPP_MARCH"] = "x86-64-v2"
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))
    if not env["TORCHINDUCTOR_CACHE_DIR"]:
        del env["TORCHINDUCTOR_CACHE_DIR"]
    out = Path(args.out or tempfile.mkdtemp(prefix="fsdp_overlap_stress."))
    print(f"runs kept under {out}; environment added: {env or 'none'}", flush=True)
    results: dict[str, list[dict]] = {}
    for variant, runs in chosen:
        results[variant] = []
        for i in range(runs):
            workdir = out / f"{variant}-{i:04d}"
            if workdir.exists():
                shutil.rmtree(workdir)
            if args.valgrind and i == 0:
                # compile once outside valgrind, so that the memcheck runs load the code
                # from inductor's cache instead of compiling under it (hours)
                warm = run_once(variant, args.steps, out / f"{variant}-warm", env, args.timeout, False, False)
                print(f"  {variant} warm-up without valgrind: {warm['end']} in {warm['seconds']} s", flush=True)
                if warm["end"] == "ok" and not args.keep_all:
                    shutil.rmtree(out / f"{variant}-warm")
            result = run_once(variant, args.steps, workdir, env, args.timeout, args.valgrind, args.cores)
            results[variant].append(result)
            if result["end"] == "ok" and not args.keep_all and not args.valgrind:
                shutil.rmtree(workdir)
            if result["end"] != "ok":
                print(f"  {variant} run {i}: {result['end']} (exit codes {result['codes']}) -> {workdir}", flush=True)
            for error in result.get("memcheck", []):
                print("  memcheck: " + error.replace("\n", "\n    "), flush=True)
        print(_summary_line(variant, results[variant]), flush=True)
    print()
    print(f"{'variant':14} {'runs':>5} {'ok':>5} {'native':>7} {'failed':>7} {'hang':>5} {'losses':>7} {'s/run':>6}")
    for variant, rows in results.items():
        print(_summary_line(variant, rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "steps": args.steps, "results": results}, indent=1))
    bad = sum(r["end"] != "ok" for rows in results.values() for r in rows)
    distinct = any(len({r["loss"] for r in rows if r["end"] == "ok"}) > 1 for rows in results.values())
    return 1 if bad or distinct else 0


def _summary_line(variant: str, rows: list[dict]) -> str:
    count = {end: sum(r["end"] == end for r in rows) for end in ("ok", "native", "failed", "hang")}
    losses = len({r["loss"] for r in rows if r["end"] == "ok"})
    mean = sum(r["seconds"] for r in rows) / max(1, len(rows))
    return (
        f"{variant:14} {len(rows):5d} {count['ok']:5d} {count['native']:7d} {count['failed']:7d} "
        f"{count['hang']:5d} {losses:7d} {mean:6.1f}"
    )


if __name__ == "__main__":
    sys.exit(main())
