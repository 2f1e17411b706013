"""The real command: ``accelerate launch --config_file configs/overlap.yaml --num_processes 2
examples/accelerate_train.py`` on a CPU-only machine, with nothing else on the command
line or in the environment (and ``fsdp-overlap launch --config ...``, training the same): 2 gloo ranks, sharded parameters, the schedule summary, the
core's losses; config-only tuning; resuming from save_state; bad YAML caught on every rank."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from _accelerate import (
    EXAMPLE,
    MODEL,
    OVERLAP_YAML,
    ROOT,
    accelerate_launch,
    copy_yaml,
    core_reference,
    fsdp_overlap,
    output,
    rank_lines,
)
from _dist import run_ranks

from fsdp_overlap_plugin import OverlapConfig

STEPS = 8  # the example's default


def _assert_bucketed(report: dict, buckets: int) -> None:
    """The plan has ``buckets`` entries, and the compiled forward shows it: one all-gather
    per bucket (every bucket here holds parameters of one dtype) where there was one per
    parameter."""
    assert len(report["plan"]) == buckets
    forward = report["forward"]
    assert forward is not None and forward["before"]["all_gather"] > buckets
    assert forward["after"]["all_gather"] == buckets
    assert forward["passes"]["manual_bucketing"]["buckets"] == buckets


@pytest.mark.slow
def test_the_real_launch_command_and_fsdp_overlap_launch(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = accelerate_launch("configs/overlap.yaml", "--metrics", str(metrics))  # relative, as a user types it
    text = output(proc)
    assert proc.returncode == 0, text[-6000:]

    # Found in the workers through the launcher's command line (Accelerate does not pass it on).
    found = re.search(
        r"fsdp-overlap settings from (\S+) \(--config_file of accelerate launch \(pid \d+\)\)", proc.stdout
    )
    assert found and Path(found.group(1)) == OVERLAP_YAML
    ranks = rank_lines(text)
    assert sorted(ranks) == [0, 1]  # two real ranks, each knowing the other
    (local0, total), (local1, _) = ranks[0], ranks[1]
    assert local0 + local1 == total and max(local0, local1) < total  # each holds a shard

    result = json.loads(metrics.read_text())
    report = result["report"]
    assert (report["world_size"], report["mesh"], report["backend"], report["mode"]) == (2, [2], "inductor", "compiled")
    assert report["config"] == OverlapConfig().to_dict()  # the YAML's values, found through the launcher
    _assert_bucketed(report, buckets=6)  # auto: embeddings, 4 blocks, norm + head
    assert "fsdp-overlap schedule: compiled, world 2" in proc.stdout and "plan: 6 buckets" in proc.stdout

    losses = [result["losses"][str(step)] for step in range(STEPS)]
    reference = run_ranks(core_reference, STEPS, "inductor", world=2, env={"OMP_NUM_THREADS": "1"})
    assert reference[0] == reference[1]
    assert losses == reference[0]  # bitwise
    assert losses[-1] < losses[0]

    # The spelling users type, through fsdp-overlap launch: the check first (with the
    # plan on the model the script builds), then the same training, bitwise.
    ours_metrics = tmp_path / "ours.json"
    model = ["--model", "fsdp_overlap_plugin.models.gpt:gpt_small"] + [f"--model-arg={k}={v}" for k, v in MODEL.items()]
    ours = fsdp_overlap(
        "launch", "--config", "configs/overlap.yaml", *model, "--num_processes", "2",
        str(EXAMPLE.relative_to(ROOT)), "--metrics", str(ours_metrics),
    )  # fmt: skip
    text = output(ours)
    assert ours.returncode == 0, text[-6000:]
    assert ours.stdout.startswith("fsdp-overlap launch: configs/overlap.yaml: OK: 6 buckets, 1 warning; passes on: ")
    assert f"fsdp-overlap settings from {OVERLAP_YAML} ($FSDP_OVERLAP_CONFIG)" in ours.stdout
    assert sorted(rank_lines(text)) == [0, 1]
    ours_result = json.loads(ours_metrics.read_text())
    assert [ours_result["losses"][str(step)] for step in range(STEPS)] == losses  # bitwise
    assert ours_result["report"]["config"] == report["config"] and ours_result["report"]["plan"] == report["plan"]


@pytest.mark.slow
def test_bucket_plans_from_the_yaml_alone_and_resume_in_a_fresh_launch(tmp_path):
    # Two copies differing only in fsdp_overlap_bucket_plans (aot_eager: compile time is not the point).
    auto = copy_yaml(tmp_path / "auto.yaml", fsdp_overlap_backend="aot_eager")
    plan = [["tok_emb", "pos_emb"], ["blocks.[0-1]"], ["blocks.[2-3]"], ["norm", "head"]]  # two blocks a bucket
    custom = copy_yaml(tmp_path / "custom.yaml", fsdp_overlap_backend="aot_eager", fsdp_overlap_bucket_plans=plan)
    a, b = yaml.safe_load(auto.read_text()), yaml.safe_load(custom.read_text())
    assert b["fsdp_config"].pop("fsdp_overlap_bucket_plans") == plan
    a["fsdp_config"].pop("fsdp_overlap_bucket_plans")
    assert a == b

    runs = tmp_path / "runs"
    first = accelerate_launch(
        custom,
        "--steps",
        "6",
        "--checkpointing_steps",
        "3",
        "--output_dir",
        str(runs),
        "--metrics",
        str(tmp_path / "a.json"),
    )
    assert first.returncode == 0, output(first)[-6000:]
    assert "plan: 4 buckets" in first.stdout
    report = json.loads((tmp_path / "a.json").read_text())["report"]
    assert report["plan"] == [
        ["tok_emb", "pos_emb"],
        ["blocks.0", "blocks.1"],
        ["blocks.2", "blocks.3"],
        ["norm", "head"],
    ]
    _assert_bucketed(report, buckets=4)

    # A fresh launch (new processes, new model) resumes from step 3 with the other copy:
    # the next losses are the first run's, whatever the buckets (they only change the schedule).
    second = accelerate_launch(
        auto, "--steps", "6", "--resume_from_checkpoint", str(runs / "step_3"), "--metrics", str(tmp_path / "b.json")
    )
    assert second.returncode == 0, output(second)[-6000:]
    assert "resumed from" in second.stdout and "plan: 6 buckets" in second.stdout
    _assert_bucketed(json.loads((tmp_path / "b.json").read_text())["report"], buckets=6)
    before = json.loads((tmp_path / "a.json").read_text())["losses"]
    after = json.loads((tmp_path / "b.json").read_text())["losses"]
    assert sorted(after) == ["3", "4", "5"]
    assert [after[s] for s in ("3", "4", "5")] == [before[s] for s in ("3", "4", "5")]


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"fsdp_overlap_bucket_plan": "auto"},
            "fsdp_config.fsdp_overlap_bucket_plan: unknown fsdp-overlap key. Did you mean 'fsdp_overlap_bucket_plans'",
        ),
        (
            {"fsdp_overlap_bucket_plans": [["tok_emb", "pos_emb"], "blocks.*", "norm", "heads"]},
            "fsdp_config.fsdp_overlap_bucket_plans[3]: no module named 'heads'",
        ),
        (
            {"fsdp_overlap_manual_bucketing": "yes"},
            "fsdp_config.fsdp_overlap_manual_bucketing: expected true or false, got 'yes' (str)",
        ),
    ],
    ids=["unknown-key", "missing-module", "wrong-type"],
)
def test_bad_yaml_fails_on_every_rank_before_training(tmp_path, change, message):
    bad = copy_yaml(tmp_path / "bad.yaml", **change)
    proc = accelerate_launch(bad, timeout=300)
    text = output(proc)
    assert proc.returncode != 0
    # printed once, short, by rank 0 (messages.py); rank 1 raised the same error and said
    # so only in the launcher's summary, through its error file
    assert text.count(message) == 1, text[-4000:]
    assert any(
        line.startswith("fsdp-overlap: configuration error: ") and message in line for line in text.splitlines()
    ), text[-4000:]
    assert "Traceback" not in text.split("fsdp-overlap: configuration error: ", 1)[0]
    assert "[rank0]: " not in text and "[rank1]: " not in text
    assert "printed above by rank 0" in text and "the same as rank 0's, printed above" in text, text[-4000:]
    assert str(bad) in text
    assert not rank_lines(text) and "step 0" not in text  # nothing was sharded or trained


@pytest.mark.slow
def test_a_rank_killed_under_max_restarts_comes_back_and_trains(tmp_path):
    """accelerate launch --max_restarts 1, rank 1 SIGKILLed in the first attempt. Before: the
    restarted ranks read the killed attempt's addresses from the launcher's store (`Gloo
    connectFullMesh failed ... Connection refused`, or a hang at 1% CPU). Now the adapter gives
    a restarted attempt's process group a store namespace of its own, and it trains."""
    config = copy_yaml(tmp_path / "overlap.yaml", fsdp_overlap_backend="aot_eager")
    script = ROOT / "tests" / "fixtures" / "accelerate_restart.py"
    proc = accelerate_launch(config, script=script, launcher_args=("--max_restarts", "1"), timeout=300)
    text = output(proc)
    assert proc.returncode == 0, text[-6000:]
    assert "fsdp-overlap: restarted attempt 1: its process group uses a store namespace of its own" in text
    losses = re.findall(r"attempt 1 rank (\d): trained a step, loss (\S+)", text)
    assert sorted(r for r, _ in losses) == ["0", "1"] and "attempt 0 rank 0: trained" not in text
    assert "Connection refused" not in text.split("restarted attempt 1", 1)[1]
