"""A configuration error in a multi-rank launch is printed once, short, naming the key and
the fix; the other ranks exit quietly; every rank exits with code 2 (messages.py).

The launches are the real ones: ``torchrun`` of a script that calls ``parallelize``,
``accelerate launch --config_file <overlap.yaml with a misspelt module>
examples/accelerate_train.py``, and a ``Trainer(devices=2)`` script that Lightning re-runs
for rank 1. In-process callers still get the exception (``pytest.raises``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _accelerate import OVERLAP_YAML, accelerate_launch, launch_env, output
from _lightning import trainer_script

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.report.messages import CONFIG_ERROR_EXIT, is_config_error

TORCHRUN = Path(sys.executable).with_name("torchrun")
MISSPELT = "pattern 'blokcs.*' matches no module"
FIX = "Did you mean 'blocks.*'?"
BAD_PLAN = [["tok_emb", "pos_emb"], ["blokcs.*"], ["norm", "head"]]

# A torchrun script: a tiny GPT, one thread per rank, the bad plan (or only on ONLY_RANK's
# rank, which then stops alone while the others wait at a barrier); SLOW_EXIT: rank 0's
# interpreter teardown takes 4 s.
CORE_SCRIPT = f"""
import os, torch, torch.distributed as dist
import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.models import gpt_small
torch.set_num_threads(1)
dist.init_process_group("gloo")
if os.environ.get("SLOW_EXIT") and dist.get_rank() == 0:  # a teardown as slow as on a loaded machine
    import atexit, time
    atexit.register(time.sleep, 4)
plan = {BAD_PLAN!r}
only = os.environ.get("ONLY_RANK")
if only is not None and int(only) != dist.get_rank():
    dist.barrier()  # this rank is fine: it waits for the others, as a real run would
else:
    fo.parallelize(gpt_small(n_layer=2, d_model=32, vocab_size=64, block_size=16), bucket_plans=plan)
"""

LIGHTNING_SCRIPT = trainer_script(
    f'FSDPOverlapStrategy(bucket_plans={BAD_PLAN!r}, backend="aot_eager")', n_layer=2, rows=4, max_steps=1
)


def _run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full = launch_env()
    full.update(env or {})
    return subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout, check=False)


def _assert_once(text: str, message: str = MISSPELT, *, fix: str = FIX, peers_quiet: bool = True) -> None:
    """The message once, with the fix; the short form, not a traceback of ours."""
    assert text.count(message) == 1, text[-6000:]
    assert text.count("fsdp-overlap: configuration error: ") == 1, text[-6000:]
    assert fix in text
    assert "FSDP_OVERLAP_TRACEBACK=1 prints the traceback" in text
    # no traceback through our code, and no "...OverlapConfigError: message" traceback tail
    assert not re.search(r'File ".*fsdp_overlap_plugin', text), text[-6000:]
    assert "OverlapConfigError: " not in text, text[-6000:]
    if peers_quiet:  # torch's hook prefixes a rank's traceback with "[rankN]: "
        assert "[rank0]" not in text and "[rank1]" not in text, text[-6000:]


# --------------------------------------------------------------------- in one process
def test_in_process_callers_still_get_the_exception():
    with pytest.raises(fo.OverlapConfigError, match="backend"):
        fo.OverlapConfig(backend="inductr")
    assert is_config_error(fo.OverlapConfigError("x"))
    assert not is_config_error(ValueError("x"))


def test_an_uncaught_config_error_is_short_and_exits_2_and_other_errors_are_untouched(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import fsdp_overlap_plugin as fo\nfo.OverlapConfig.coerce({'backend': 'inductr'})\n")
    proc = _run([sys.executable, str(script)], tmp_path)
    assert proc.returncode == CONFIG_ERROR_EXIT, proc.stderr
    assert proc.stderr.splitlines() == [
        "fsdp-overlap: configuration error: backend: unknown backend 'inductr'; valid: inductor, aot_eager. "
        "Did you mean 'inductor'?",
        "fsdp-overlap: raised in OverlapConfig.coerce, from train.py:2 "
        "(`fo.OverlapConfig.coerce({'backend': 'inductr'})`); FSDP_OVERLAP_TRACEBACK=1 prints the traceback",
    ]
    # the traceback on request, same exit code
    proc = _run([sys.executable, str(script)], tmp_path, env={"FSDP_OVERLAP_TRACEBACK": "1"})
    assert proc.returncode == CONFIG_ERROR_EXIT
    assert "Traceback (most recent call last)" in proc.stderr and "OverlapConfigError: backend" in proc.stderr
    # any other exception goes to the previous hook as before
    other = tmp_path / "other.py"
    other.write_text("import fsdp_overlap_plugin\nraise ValueError('not ours')\n")
    proc = _run([sys.executable, str(other)], tmp_path)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and "ValueError: not ours" in proc.stderr


def test_a_quiet_rank_waits_for_rank_0s_process_to_end(monkeypatch):
    """The launcher names the first rank to exit as the root cause: the quiet rank waits
    until rank 0's process is gone or a zombie (a pause after rank 0's "done" alone lost
    that race on a loaded machine), and gives up after WAIT_S."""
    from fsdp_overlap_plugin.report import messages

    monkeypatch.setattr(messages, "WAIT_S", 0.3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not messages._wait_for_exit(child.pid)  # alive: bounded, then False
        child.kill()
        assert messages._wait_for_exit(child.pid)  # a zombie until reaped
    finally:
        child.kill()
        child.wait()
    assert messages._wait_for_exit(child.pid)  # reaped: gone


# --------------------------------------------------------------------- real launches
@pytest.mark.slow
def test_torchrun_prints_a_plan_error_once_and_names_it_in_the_launcher_summary(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CORE_SCRIPT)
    # rank 0's exit takes 4 s after its message: rank 1 must still exit after it
    proc = _run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(script)], tmp_path, env={"SLOW_EXIT": "1"})
    text = output(proc)
    assert proc.returncode != 0
    _assert_once(text)
    assert "bucket_plans[1][0]" in text  # the key
    assert "on rank 0" in text and "raised in parallelize, from train.py:" in text
    # the launcher's summary: rank 0 exited 2 and is the root cause; its line points at the message
    root = text.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 0 (local_rank: 0)" in root and "exitcode  : 2" in root, text[-3000:]
    assert "fsdp-overlap: configuration error (OverlapConfigError), printed above by rank 0" in root
    assert "To enable traceback see" not in text


@pytest.mark.slow
def test_a_rank_alone_with_an_error_prints_it_itself(tmp_path):
    """Rank 1 alone raises (rank 0 waits at a barrier): rank 0 reports nothing, so rank 1
    prints after waiting for it, naming itself."""
    script = tmp_path / "train.py"
    script.write_text(CORE_SCRIPT)
    proc = _run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(script)], tmp_path, env={"ONLY_RANK": "1"})
    text = output(proc)
    assert proc.returncode != 0
    # rank 0's barrier then fails (its peer is gone): gloo's error, with its traceback
    _assert_once(text, peers_quiet=False)
    assert "on rank 1 (rank 0 did not report this error within 10 s)" in text
    assert "[rank1]" not in text  # no warnings of the store while rank 1 waited
    assert "exitcode  : 2" in text


@pytest.mark.slow
def test_accelerate_launch_prints_a_yaml_plan_error_once(tmp_path):
    data = yaml.safe_load(OVERLAP_YAML.read_text())
    data["fsdp_config"]["fsdp_overlap_bucket_plans"] = BAD_PLAN
    bad = tmp_path / "overlap.yaml"
    bad.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = accelerate_launch(bad)  # a native crash would fail the test here (_launch)
    text = output(proc)
    assert proc.returncode != 0
    _assert_once(text)
    assert "fsdp_config.fsdp_overlap_bucket_plans[1][0]" in text  # the key as the YAML spells it
    assert "raised in prepare, from examples/accelerate_train.py:" in text
    assert "printed above by rank 0" in text.split("Root Cause", 1)[1]


@pytest.mark.slow
def test_lightning_trainer_devices_2_prints_a_plan_error_once_and_exits_2(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(LIGHTNING_SCRIPT)
    proc = _run([sys.executable, str(script)], tmp_path)  # Lightning re-runs it for rank 1
    text = output(proc)
    assert proc.returncode == CONFIG_ERROR_EXIT, text[-6000:]
    _assert_once(text)
    assert "bucket_plans[1][0]" in text
    assert "from train.py:" in text and "on rank 0" in text


@pytest.mark.slow
def test_an_error_under_torchs_own_hook_is_printed_once_too(tmp_path):
    """init_process_group wraps the hook it finds in its own ("[rankN]: " before each line of
    a captured stderr); a config error raised before any plugin entry point re-installs
    ours is still printed once, unprefixed, with exit code 2."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch.distributed as dist\nimport fsdp_overlap_plugin as fo\n"
        "dist.init_process_group('gloo')\nfo.OverlapConfig.coerce({'backend': 'inductr'})\n"
    )
    proc = _run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(script)], tmp_path)
    text = output(proc)
    _assert_once(text, "unknown backend 'inductr'; valid: inductor, aot_eager", fix="Did you mean 'inductor'?")
    assert "exitcode  : 2" in text.split("Root Cause", 1)[1]
