"""A checkpoint on disk is complete or absent (``shard/atomic_checkpoint.py``), for every
way the plugin saves: ``shard.checkpoint.save`` under torchrun, Lightning's top-k and
``last.ckpt`` checkpoints, Accelerate's ``save_state``.

The quick tests hold the pure logic on folders a test writes: a save replaces a checkpoint
only by a complete one, what a folder lacks and which complete checkpoint lies beside
it, leftovers of a killed save.

The slow ones preempt a rank the way a real preemption looks: SIGKILL right after that
rank has written its part of the checkpoint (torch's writers patched in the training
script, tests/fixtures/preempt.py; never the plugin), while the other rank is still
saving. Then: what a restarted job finds on disk is the previous complete checkpoint
(``last.ckpt`` still says the previous step) and no visible folder lacks a file; it
resumes from there and ends with the weights, optimizer state and loop state of an
uninterrupted run restarted at the same steps, bit for bit (fp32 on gloo: every path
reads back exactly what it wrote); and loading a copy that lost its ``.metadata`` or one
rank's file fails on every rank with a message that names the file and the newest
complete checkpoint beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from _accelerate import accelerate_launch, copy_yaml, output
from _dist import raise_on_native_crash

from fsdp_overlap_plugin.accelerate import checkpointing as accelerate_checkpointing
from fsdp_overlap_plugin.shard import atomic_checkpoint as atomic
from fsdp_overlap_plugin.shard.atomic_checkpoint import (
    MANIFEST,
    IncompleteCheckpointError,
    check_complete,
    incomplete_message,
    missing_files,
    newest_complete,
    retire,
    written_atomically,
)

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
STEPS = 5


# ----------------------------------------------------------------------- quick: on disk
def _dcp_folder(path: Path, value: float) -> None:
    """A real one-process DCP checkpoint (``.metadata`` + ``__0_0.distcp``) at ``path``."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.full((8,), value)}, checkpoint_id=str(path))


def _dcp_value(path: Path) -> float:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.zeros(8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path))
    return state["w"][0].item()


def _save(final: Path, value: float, step: int | None = None) -> None:
    with written_atomically(final, step=step) as partial:
        _dcp_folder(partial, value)


def test_a_save_replaces_a_checkpoint_only_by_a_complete_one(tmp_path):
    last = tmp_path / "last.ckpt"
    _save(last, 1.0, step=1)
    _save(last, 2.0, step=2)  # the same name again: swapped for the new one
    assert _dcp_value(last) == 2.0
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # nothing hidden left behind
    manifest = json.loads((last / MANIFEST).read_text())
    assert manifest["step"] == 2 and manifest["ranks"] == 1
    assert manifest["files"] == {n: (last / n).stat().st_size for n in (".metadata", "__0_0.distcp")}
    assert missing_files(last) == []

    with pytest.raises(RuntimeError, match="killed"), written_atomically(last, step=3) as partial:
        _dcp_folder(partial, 3.0)
        raise RuntimeError("killed")  # what a save cut short leaves: the old one, and a leftover
    assert _dcp_value(last) == 2.0 and (tmp_path / ".last.ckpt.partial").is_dir()
    _save(last, 4.0, step=4)  # the next save of that name removes the leftover
    assert _dcp_value(last) == 4.0 and sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_where_the_filesystem_cannot_swap_the_old_one_is_kept_until_the_new_one_is_in(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    _save(tmp_path / "ckpt", 1.0)
    _save(tmp_path / "ckpt", 2.0)
    assert _dcp_value(tmp_path / "ckpt") == 2.0 and os.listdir(tmp_path) == ["ckpt"]
    # a kill between its two renames: the name is missing, the old one sits aside, complete
    os.rename(tmp_path / "ckpt", tmp_path / ".ckpt.old")
    message = incomplete_message(tmp_path / "ckpt")
    assert message is not None and ".ckpt.old" in message and "Rename it back to ckpt" in message


def test_a_folder_that_holds_no_checkpoint_is_never_replaced(tmp_path):
    mine = tmp_path / "results"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"results exists and holds no checkpoint \(notes.txt\)"):
        _save(mine, 1.0)
    assert os.listdir(mine) == ["notes.txt"] and sorted(os.listdir(tmp_path)) == ["results"]
    (tmp_path / "empty").mkdir()
    _save(tmp_path / "empty", 1.0)  # an empty folder is no loss
    assert _dcp_value(tmp_path / "empty") == 1.0


def test_leftovers_of_killed_saves_go_and_a_users_hidden_files_stay(tmp_path):
    for leftover in (".epoch=0-step=3.ckpt.partial", ".old.ckpt.removing"):
        _dcp_folder(tmp_path / leftover, 0.0)
    (tmp_path / ".last.ckpt.partial").write_bytes(b"half a file")  # this name's own leftover, a file
    (tmp_path / ".cache.partial").mkdir()  # not a checkpoint: not ours to delete
    (tmp_path / ".cache.partial" / "data").write_text("x")
    _save(tmp_path / "last.ckpt", 1.0)
    assert sorted(os.listdir(tmp_path)) == [".cache.partial", "last.ckpt"]


def test_retire_renames_out_of_sight_before_deleting(tmp_path):
    _save(tmp_path / "a.ckpt", 1.0)
    os.symlink("a.ckpt", tmp_path / "last.ckpt")  # Lightning's save_last="link"
    retire(tmp_path / "last.ckpt")  # the link goes, its target stays
    assert os.listdir(tmp_path) == ["a.ckpt"]
    retire(tmp_path / "a.ckpt")
    retire(tmp_path / "a.ckpt")  # gone already: nothing to do
    assert os.listdir(tmp_path) == []


def test_what_a_folder_lacks_is_named_file_by_file(tmp_path):
    ckpt = tmp_path / "step_2"
    _save(ckpt, 1.0, step=2)
    (ckpt / "meta.pt").write_bytes(b"loop state")  # (after the manifest: not listed, only required)
    shard = ckpt / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:10])
    assert missing_files(ckpt) == [
        f"`__0_0.distcp` (rank 0's shard) holds 10 bytes, not the {len(data)} it was written with"
    ]
    shard.unlink()
    assert missing_files(ckpt) == ["`__0_0.distcp` (rank 0's shard) is missing"]
    (ckpt / "meta.pt").unlink()
    assert missing_files(ckpt, ["meta.pt"])[-1] == "`meta.pt` (Lightning's loop and callback state) is missing"

    # without a manifest (a folder another tool wrote): what DCP's index lists
    plain = tmp_path / "plain"
    _dcp_folder(plain, 1.0)
    assert missing_files(plain) == []
    (plain / "__0_0.distcp").unlink()
    assert missing_files(plain) == ["`__0_0.distcp` (rank 0's shard) is missing"]
    _dcp_folder(tmp_path / "noindex", 1.0)
    (tmp_path / "noindex" / ".metadata").unlink()
    assert missing_files(tmp_path / "noindex") == [
        "`.metadata` (the index of every rank's shards, written last) is missing"
    ]
    accelerate = tmp_path / "accelerate"
    _dcp_folder(accelerate / "pytorch_model_fsdp_0", 1.0)
    (accelerate / "pytorch_model_fsdp_0" / ".metadata").unlink()
    assert missing_files(accelerate) == [
        "`pytorch_model_fsdp_0/.metadata` (the index of every rank's shards, written last) is missing"
    ]
    assert missing_files(tmp_path / "gone") == ["gone (the checkpoint itself)"]


def test_the_newest_complete_checkpoint_beside_an_incomplete_one(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path / f"step={step}.ckpt", float(step), step=step)
        time.sleep(0.01)  # distinct completion times
    (tmp_path / "step=3.ckpt" / "__0_0.distcp").unlink()
    _dcp_folder(tmp_path / ".step=4.ckpt.partial", 4.0)  # hidden: never a candidate
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert newest_complete(tmp_path) == (tmp_path / "step=2.ckpt", 2)
    assert newest_complete(tmp_path, exclude=tmp_path / "step=2.ckpt") == (tmp_path / "step=1.ckpt", 1)

    message = incomplete_message(tmp_path / "step=3.ckpt")
    assert message == (
        f"the checkpoint {tmp_path / 'step=3.ckpt'} is incomplete: `__0_0.distcp` (rank 0's shard) is missing. A save "
        "that was killed before every rank had written, or files removed since; it cannot be loaded. The newest "
        f"complete checkpoint beside it: {tmp_path / 'step=2.ckpt'} (step 2); resume from that one."
    )
    with pytest.raises(IncompleteCheckpointError, match="step=3.ckpt is incomplete"):
        check_complete(tmp_path / "step=3.ckpt")
    check_complete(tmp_path / "step=2.ckpt")
    assert incomplete_message(tmp_path / "step=9.ckpt").startswith(f"no checkpoint at {tmp_path / 'step=9.ckpt'}.")
    (tmp_path / "step=1.ckpt" / ".metadata").unlink()
    (tmp_path / "step=2.ckpt" / ".metadata").unlink()
    assert incomplete_message(tmp_path / "step=3.ckpt").endswith(
        f"No complete checkpoint lies beside it in {tmp_path}."
    )


def test_export_names_an_incomplete_folder(tmp_path):
    from fsdp_overlap_plugin.config.schema import OverlapConfigError
    from fsdp_overlap_plugin.shard.checkpoint_reader import open_checkpoint

    _save(tmp_path / "step_1", 1.0, step=1)
    _save(tmp_path / "step_2", 2.0, step=2)
    assert open_checkpoint(tmp_path / "step_2").entries == {"w": ((8,), torch.float32)}
    (tmp_path / "step_2" / "__0_0.distcp").unlink()
    with pytest.raises(OverlapConfigError, match=r"step_2 is incomplete: `__0_0.distcp` \(rank 0's shard\) is missing"):
        open_checkpoint(tmp_path / "step_2")


def test_accelerate_numbering_ignores_leftovers_and_rotates_after_the_save(tmp_path):
    for name in ("checkpoint_1", "checkpoint_2", "checkpoint_10", ".checkpoint_11.partial"):
        (tmp_path / name).mkdir()
    assert accelerate_checkpointing._newest_numbered(tmp_path) == str(tmp_path / "checkpoint_10")
    accelerate_checkpointing._rotate(tmp_path, 2)
    assert sorted(os.listdir(tmp_path)) == [".checkpoint_11.partial", "checkpoint_10", "checkpoint_2"]
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        accelerate_checkpointing._newest_numbered(tmp_path / "none")


# ------------------------------------------------------------------ slow: killed saves
_LAUNCH_ENV = ("MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_", "ROLE_", "TORCHELASTIC_",
               "ACCELERATE_")  # fmt: skip


def _torchrun(tmp: Path, script: str, *args: str, restarts: int) -> list[dict]:
    """``torchrun --max-restarts`` of a killed-save script; every attempt must end as
    planned (a planned SIGKILL writes no faulthandler file: any text there is an unplanned
    native crash, which fails the test, counted, never rerun). Returns the events."""
    result, out = tmp / "events.jsonl", tmp / "torchrun.out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(restarts), str(FIXTURES / script), "--dir", str(tmp), "--result", str(result),
           "--steps", str(STEPS), *args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_ENV)}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])]), OMP_NUM_THREADS="1")
    with open(out, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=400, env=env, cwd=tmp)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun {script} timed out; its output ends:\n{out.read_text()[-6000:]}")
    _check_ranks(tmp, f"torchrun {script} ended with {proc.returncode}:\n{out.read_text()[-6000:]}", proc.returncode)
    return _events(result)


def _check_ranks(tmp: Path, failure: str, returncode: int) -> None:
    crash_logs = {p.name: p.read_text(errors="replace") for p in sorted((tmp / "crashes").glob("*.txt"))}
    raise_on_native_crash(crash_logs, failure)
    assert returncode == 0, failure


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _one(events: list[dict], kind: str, **where) -> list[dict]:
    return [e for e in events if e["event"] == kind and all(e[k] == v for k, v in where.items())]


def _assert_killed(events: list[dict], kills: list[tuple[int, int, int]]) -> None:
    """Each planned kill happened, once: (attempt, rank, save)."""
    assert [(e["attempt"], e["rank"], e["save"]) for e in _one(events, "kill")] == kills


def _assert_equal_runs(tmp: Path) -> dict:
    """The run killed mid-save and the uninterrupted reference end equal: every weight,
    every optimizer tensor and number, the loop state; bit for bit."""
    final = torch.load(tmp / "final.pt", weights_only=False)
    reference = torch.load(tmp / "reference.pt", weights_only=False)
    assert final["params"].keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        assert torch.equal(final["params"][name], value), name
    ours, theirs = pytree.tree_flatten(final["optim"]), pytree.tree_flatten(reference["optim"])
    assert ours[1] == theirs[1]  # the same structure: parameters, state keys, param groups
    assert len(ours[0]) > 20
    for a, b in zip(ours[0], theirs[0]):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b
    assert {k: v for k, v in final.items() if k not in ("params", "optim")} == {
        k: v for k, v in reference.items() if k not in ("params", "optim")
    }
    return final


def _assert_named(events: list[dict], expected: dict[str, list[str]]) -> None:
    """Loading each broken copy failed on both ranks, with the same message, naming the
    missing file and the newest complete checkpoint beside it."""
    for lost, words in expected.items():
        messages = [e["message"] for e in _one(events, "incomplete", lost=lost)]
        assert len(messages) == 2 and messages[0] == messages[1], messages
        assert messages[0] is not None, f"loading a copy without {lost} did not fail"
        for word in words:
            assert word in messages[0], (word, messages[0])


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.slow
@pytest.mark.newest_torch  # CI runs it on 2.15, the newest torch (DCP writes the files it kills)
def test_checkpoint_save_killed_mid_save_resumes_from_the_last_complete_step(tmp_path):
    events = _torchrun(
        tmp_path,
        "killed_save_torchrun.py",
        "--plan", "kill:3:1,end", "--restarts", "2", "--check-incomplete",
        restarts=1,
    )  # fmt: skip
    _assert_killed(events, [(0, 1, 3)])
    (start,) = _one(events, "start")
    assert start["latest"] == "step_00000002"
    assert start["entries"] == [".step_00000003.partial", "latest", "step_00000001", "step_00000002"]
    assert start["gaps"] == {"latest": [], "step_00000001": [], "step_00000002": []}
    assert {e["step"] for e in _one(events, "resumed", attempt=1, folder="run")} == {2}
    assert _assert_equal_runs(tmp_path)["step"] == STEPS
    newest = f"The newest complete checkpoint beside it: {tmp_path / 'run' / 'ckpt' / 'step_00000005'} (step 5)"
    _assert_named(
        events,
        {
            ".metadata": ["step_90000000 is incomplete: `.metadata`", newest],
            "__1_0.distcp": ["step_90000001 is incomplete: `__1_0.distcp` (rank 1's shard) is missing", newest],
        },
    )
    assert _hidden(tmp_path / "run" / "ckpt") == []


@pytest.mark.slow
@pytest.mark.newest_torch  # CI runs it on 2.15, the newest torch (DCP writes the files it kills)
def test_lightning_top_k_and_last_ckpt_killed_mid_save_resume_from_the_last_complete_step(tmp_path):
    # attempt 0: rank 1 killed in the top-k save of step 3; attempt 1 (resumed at step 2):
    # rank 0 killed in the last.ckpt save of step 4, after its shard, before meta.pt
    events = _torchrun(
        tmp_path,
        "killed_save_lightning.py",
        "--plan", "kill:5:1,kill:4:0,end", "--restarts", "2,3", "--check-incomplete",
        restarts=2,
    )  # fmt: skip
    _assert_killed(events, [(0, 1, 5), (1, 0, 4)])
    first, second = _one(events, "start")
    assert first["last_step"] == 2
    assert first["entries"] == [
        ".epoch=0-step=3.ckpt.partial",
        "epoch=0-step=1.ckpt",
        "epoch=0-step=2.ckpt",
        "last.ckpt",
    ]
    assert second["last_step"] == 3  # step 4's top-k checkpoint is complete; last.ckpt still says 3
    assert second["entries"] == [".last.ckpt.partial", "epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    for start in (first, second):  # every visible folder is complete
        assert start["gaps"] == {name: [] for name in start["entries"] if not name.startswith(".")}
    final = _assert_equal_runs(tmp_path)
    assert final["loop"]["global_step"] == STEPS and final["loop"]["batches_that_stepped"] == STEPS
    newest = f"The newest complete checkpoint beside it: {tmp_path / 'run' / 'ckpt' / 'last.ckpt'} (step 5)"
    _assert_named(
        events,
        {
            ".metadata": ["broken-index.ckpt is incomplete: `.metadata`", newest],
            "__1_0.distcp": ["broken-shard.ckpt is incomplete: `__1_0.distcp` (rank 1's shard) is missing", newest],
        },
    )
    assert _hidden(tmp_path / "run" / "ckpt") == []  # each leftover went with the next save of its name


@pytest.mark.slow
@pytest.mark.newest_torch  # CI runs it on 2.15, the newest torch (DCP writes the files it kills)
def test_accelerate_save_state_killed_mid_save_resumes_from_the_last_complete_step(tmp_path):
    config = copy_yaml(tmp_path / "overlap.yaml", fsdp_overlap_backend="aot_eager")
    script = FIXTURES / "killed_save_accelerate.py"
    common = ["--dir", str(tmp_path), "--result", str(tmp_path / "events.jsonl"), "--steps", str(STEPS)]
    common += ["--plan", "kill:3:1,end"]
    # the job preempted in its third save_state, then launched again
    killed = accelerate_launch(config, *common, "--attempt", "0", script=script, timeout=400)
    assert killed.returncode != 0 and "exitcode: -9" in output(killed), output(killed)[-6000:]
    resumed = accelerate_launch(
        config, *common, "--attempt", "1", "--restarts", "2", "--check-incomplete", script=script, timeout=400
    )
    _check_ranks(tmp_path, output(resumed)[-6000:], resumed.returncode)
    events = _events(tmp_path / "events.jsonl")
    _assert_killed(events, [(0, 1, 3)])
    (start,) = _one(events, "start")
    assert start["entries"] == [".checkpoint_3.partial", "checkpoint_1", "checkpoint_2"]
    assert start["gaps"] == {"checkpoint_1": [], "checkpoint_2": []}
    assert {e["step"] for e in _one(events, "resumed", attempt=1, folder="run")} == {2}
    assert _assert_equal_runs(tmp_path)["step"] == STEPS
    newest = f"The newest complete checkpoint beside it: {tmp_path / 'run' / 'checkpoints' / 'checkpoint_5'};"
    lost = [e["lost"] for e in _one(events, "incomplete", rank=0)]
    assert lost[0] == "random_states_1.pkl" and lost[1] in ("model.safetensors", "pytorch_model_fsdp_0/.metadata")
    _assert_named(
        events,
        {
            "random_states_1.pkl": [
                "broken-states is incomplete: `random_states_1.pkl` (rank 1's random states)",
                newest,
            ],
            lost[1]: [f"broken-index is incomplete: `{lost[1]}`", newest],
        },
    )
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == [
        "broken-index", "broken-states", "checkpoint_4", "checkpoint_5"
    ]  # fmt: skip
