"""Peak memory of ``fsdp-overlap export`` on a checkpoint many times larger than that peak.

Writes a ``torch.distributed.checkpoint`` folder in ``fsdp_overlap_plugin.shard.checkpoint.save``'s
layout (``{"model": state_dict}``) for a transformers Llama built from a config (2048 wide,
``--layers`` decoder layers, vocabulary ``--vocab``, untied, fp32: 11.8 GB at the default 64
layers and vocabulary 16384),
then runs ``fsdp-overlap export CHECKPOINT OUT --model hf:config.json`` in a child process and
reports the child's peak resident memory (its ``VmHWM``) against the checkpoint's size.

What the peak is made of: the interpreter with torch and transformers imported, plus a few
copies of the tensor being written (DCP reads a chunk, unpickles it into a tensor and copies
that into the tensor asked for; then it is written). It grows with the largest tensor, the
embedding (``--vocab`` x 2048 x 4 bytes), not with the number of layers. Measured here
(2026-12-04): vocabulary 16384 (largest tensor 134 MB), 11.81 GB exported with a peak of
0.74 GB in 46 s; vocabulary 32000 (262 MB), 12.07 GB with 0.96 GB in 53 s.

    python benchmarks/export_memory.py                 # ~24 GB of disk under --dir, ~12 GB of memory, minutes
    python benchmarks/export_memory.py --layers 8      # a quick run

The weights are random; the export is checked tensor by tensor against them (a sample of
rows), and the whole output is loaded by safetensors' reader (shapes and dtypes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def build_checkpoint(root: Path, layers: int, vocab: int) -> tuple[Path, Path, int, dict]:
    import torch.distributed.checkpoint as dcp
    from _harness.models import build_llama, llama_config

    # hidden 2048, 16 heads / 4 kv heads, MLP 5632, untied; transformers' default positions
    config = llama_config(2048, layers, 16, 4, 5632, vocab)
    config_dir = root / "config"
    config.save_pretrained(config_dir)
    shapes = {k: tuple(v.shape) for k, v in build_llama(config, device="meta").state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    state = {k: torch.randn(shape, generator=generator) for k, shape in shapes.items()}
    samples = {k: v[:2].clone() for k, v in state.items()}  # the first rows, to check the export
    checkpoint = root / "run" / "step_00000001"
    started = time.perf_counter()
    with torch.no_grad():
        dcp.save({"model": state}, checkpoint_id=checkpoint)
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    print(f"wrote {checkpoint} ({nbytes / 1e9:.2f} GB, {len(state)} tensors) in {time.perf_counter() - started:.0f} s")
    del state
    return checkpoint, config_dir, nbytes, samples


# The export in a process of its own, which reports its own peak resident memory: the
# kernel's VmHWM of the process image (a forked child's ru_maxrss would count the pages it
# shared with this parent, which holds the checkpoint's tensors, until its exec).
_CHILD = """
import json, sys
from fsdp_overlap_plugin.cli import main
code = main(sys.argv[1:])
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"code": code, "VmHWM_kib": peak}))
sys.exit(code)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder, removed after)")
    parser.add_argument("--json", default=None, help="write the numbers here")
    args = parser.parse_args()

    root = Path(args.dir or tempfile.mkdtemp(prefix="export_memory_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        checkpoint, config_dir, nbytes, samples = build_checkpoint(root, args.layers, args.vocab)
        out = root / "exported"
        argv = ["export", str(checkpoint), str(out), "--model", f"hf:{config_dir}"]
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"export failed:\n{proc.stdout}\n{proc.stderr}")
        *lines, last = proc.stdout.strip().splitlines()
        print("\n".join(lines))
        peak_kib = json.loads(last)["VmHWM_kib"]
        from safetensors import safe_open

        index_file = out / "model.safetensors.index.json"
        index = json.loads(index_file.read_text()) if index_file.exists() else None
        files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
        checked = 0
        for name in files:
            with safe_open(str(out / name), framework="pt") as handle:
                for key in handle.keys():
                    rows = handle.get_slice(key)[:2]
                    assert torch.equal(rows, samples[key]), key
                    checked += 1
        assert checked == len(samples), (checked, len(samples))
        peak = peak_kib * 1024
        result = {
            "checkpoint_bytes": nbytes,
            "tensors": len(samples),
            "export_peak_rss_bytes": peak,
            "checkpoint_over_peak": round(nbytes / peak, 1),
            "seconds": round(seconds, 1),
            "checked_tensors": checked,
        }
        print(
            f"fsdp-overlap export: checkpoint {nbytes / 1e9:.2f} GB, peak resident memory {peak / 1e9:.2f} GB "
            f"({nbytes / peak:.1f}x smaller than the checkpoint), {seconds:.0f} s; "
            f"{checked} tensors checked (first rows)"
        )
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
