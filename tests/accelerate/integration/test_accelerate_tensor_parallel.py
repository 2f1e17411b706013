"""Tensor parallel x FSDP through Accelerate, as its users write it: ``accelerate launch`` of 4
gloo ranks at data-parallel 2 x tensor-parallel 2 (tests/fixtures/tensor_parallel_accelerate.py).

* ``config``: the launch YAML alone (``parallelism_config_tp_size: 2``, the plugin's
  ``tp_plan``), a plain Accelerate script (``accelerator.prepare``), the repo GPT;
* ``own``: a live ``ParallelismConfig(dp_shard_size=2, tp_size=2)``, the user's own
  ``parallelize_module`` on ``accelerator.torch_device_mesh["tp"]`` (an untied Qwen2), then,
  in the same job, a tied Llama with ``tp_plan="auto"`` (transformers' own plan).

Each model trains like one process on what Accelerate's data loader gave the
data-parallel ranks (the two ranks of a tensor-parallel group get the same batches, the
data-parallel ranks different ones): losses and final weights within 1e-5. Every rank
starts from its own seed, so the match also shows ``fsdp_sync_module_states`` spread rank
0's weights, split parameters included. ``save_state`` (SHARDED_STATE_DICT) of the config
job, loaded by a third job (``config_resume``) built from other seeds, resumes it bitwise.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from _accelerate import OVERLAP_YAML, ROOT, accelerate_launch, output

# CI: on its 2.14 leg (passed there and on 2.13), to keep the main lane short
pytestmark = [pytest.mark.slow, pytest.mark.middle_torch]

SCRIPT = ROOT / "tests" / "fixtures" / "tensor_parallel_accelerate.py"
WORLD, TP = 4, 2
TOL = 1e-5
GPT_PLAN = {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}


def _yaml(path, spelling: str):
    data = yaml.safe_load(OVERLAP_YAML.read_text())
    data["num_processes"] = WORLD
    data["fsdp_config"].update(fsdp_overlap_backend="aot_eager", fsdp_sync_module_states=True)
    if spelling.startswith("config"):
        data["parallelism_config"] = {"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": TP}
        data["fsdp_config"]["fsdp_overlap_tp_plan"] = GPT_PLAN
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _launch(tmp_path, spelling: str) -> list[dict]:
    out = tmp_path / spelling
    out.mkdir()
    proc = accelerate_launch(
        _yaml(tmp_path / f"{spelling}.yaml", spelling),
        spelling,
        str(out),
        script=SCRIPT,
        launcher_args=("--num_processes", str(WORLD)),
        env={"TORCHINDUCTOR_COMPILE_THREADS": "1"},
    )
    text = output(proc)
    assert proc.returncode == 0, text[-6000:]
    assert f"tensor parallel through Accelerate: {spelling} trained" in text
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("tp_accelerate")
    return {spelling: _launch(tmp, spelling) for spelling in ("config", "config_resume", "own")}


def _job():
    """The launched script as a module (its models, data and losses)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tensor_parallel_accelerate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(name: str, ranks: list[dict]) -> tuple[list[float], dict]:
    """One process, rank 0's seed, SGD on each step's batches of both data-parallel ranks."""
    import _hf
    from _train import full_params

    job = _job()

    if name == "gpt":
        from fsdp_overlap_plugin.models.gpt import gpt_small

        torch.manual_seed(0)
        model, loss = gpt_small(**job.GPT), job.gpt_loss
        optimizer = torch.optim.SGD(model.parameters(), lr=job.LR, momentum=0.9)  # state for the resumed job
    else:
        model, loss = _hf.build("qwen2" if name == "qwen2_own" else "llama", seed=0), job.hf_loss
        optimizer = torch.optim.SGD(model.parameters(), lr=job.LR)
    losses = []
    for step in range(len(ranks[0][name]["batches"])):
        ids = torch.cat([ranks[dp * TP][name]["batches"][step] for dp in range(WORLD // TP)])
        value = loss(model, ids)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(value.item())
    return losses, full_params(model)


@pytest.mark.parametrize(
    "spelling, name", [("config", "gpt"), ("own", "qwen2_own"), ("own", "llama_auto")], ids=lambda v: v
)
def test_trains_like_one_process(launched, spelling, name):
    ranks = launched[spelling]
    runs = [r[name] for r in ranks]
    # Accelerate's loader knows the tensor dimension: a tensor-parallel pair shares batches,
    # the data-parallel ranks differ
    for step, batch in enumerate(runs[0]["batches"]):
        assert torch.equal(batch, runs[1]["batches"][step])
        assert torch.equal(runs[2]["batches"][step], runs[3]["batches"][step])
        assert not torch.equal(batch, runs[2]["batches"][step])
    assert len(runs[0]["batches"]) == 4
    ref_losses, ref_params = _reference(name, ranks)
    # the mean of the data-parallel ranks' losses is the reference's loss on both batches
    ours = [(runs[0]["losses"][s] + runs[2]["losses"][s]) / 2 for s in range(len(ref_losses))]
    assert max(abs(a - b) for a, b in zip(ours, ref_losses)) <= TOL, (ours, ref_losses)
    for run in runs:
        assert run["params"].keys() == ref_params.keys()
        worst = max((run["params"][k] - ref_params[k]).abs().max().item() for k in ref_params)
        assert worst <= TOL, worst
    assert runs[0]["tensor_parallel"] == TP


def test_the_plans_are_the_three_spellings(launched):
    assert launched["config"][0]["gpt"]["tp_plan"] == {
        "blocks.0.mlp.fc": "colwise",
        "blocks.0.mlp.proj": "rowwise",
        "blocks.1.mlp.fc": "colwise",
        "blocks.1.mlp.proj": "rowwise",
    }
    assert launched["own"][0]["qwen2_own"]["tp_plan"] == {}  # the user's own split: nothing applied by the plugin
    auto = launched["own"][0]["llama_auto"]["tp_plan"]
    assert auto["model.layers.0.self_attn.q_proj"] == "colwise" and auto["model.layers.1.mlp.down_proj"] == "rowwise"


@pytest.mark.parametrize(
    "spelling, name", [("config", "gpt"), ("own", "qwen2_own"), ("own", "llama_auto")], ids=lambda v: v
)
def test_the_passes_bucket_the_data_parallel_collectives_and_count_the_plans(launched, spelling, name):
    report = launched[spelling][0][name]["report"]
    buckets = len(report["plan"])
    assert report["mesh"] == [WORLD // TP] and report["tensor_parallel"]["size"] == TP
    assert report["forward"]["after"]["all_gather"] == buckets
    assert report["backward"]["after"]["reduce_scatter"] == buckets
    # one all-reduce after each rowwise layer (2 layers): the GPT's MLP; attention and MLP in transformers'
    tp_forward = report["forward"]["tensor_parallel"]["after"]
    assert tp_forward["all_reduce"] == 2 * (1 if name == "gpt" else 2), tp_forward
    assert report["forward"]["tensor_parallel"]["before"] == tp_forward  # left where the plan put them


def test_save_state_resumes_bitwise_in_a_second_job(launched):
    """``save_state`` before step 3 (SHARDED_STATE_DICT: torch.distributed.checkpoint of the
    2 x 2 model and its momentum), loaded by a new job whose ranks built other weights: steps
    3-4 are the first job's, bitwise."""
    first, resumed = launched["config"], launched["config_resume"]
    for before, after in zip(first, resumed):
        assert after["gpt"]["losses"] == before["gpt"]["losses"][2:]
        for step, batch in enumerate(after["gpt"]["batches"]):
            assert torch.equal(batch, before["gpt"]["batches"][2 + step])
        for name, value in before["gpt"]["params"].items():
            assert torch.equal(after["gpt"]["params"][name], value), name


def test_get_state_dict_gathers_over_both_dimensions(launched):
    ranks = launched["config"]
    full = ranks[0]["gpt"]["state_dict"]
    assert full.keys() == ranks[0]["gpt"]["params"].keys()
    for name, value in ranks[0]["gpt"]["params"].items():
        assert torch.equal(full[name], value), name
    assert all(r["gpt"]["state_dict"] == {} for r in ranks[1:])  # rank 0 only, as Accelerate's FSDP2 path


def test_save_state_writes_both_tensor_parallel_models(launched):
    for rank in launched["own"]:
        assert rank["saved_models"] == ["pytorch_model_fsdp_0", "pytorch_model_fsdp_1"], rank["saved_models"]
