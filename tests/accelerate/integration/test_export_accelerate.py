"""A trained model out of an Accelerate run, by Accelerate's own recipes, on 2 gloo ranks.

``accelerate launch --config_file <overlap.yaml> --num_processes 2
tests/fixtures/export_accelerate.py`` trains a tied Llama with an odd (97) and an even (96)
vocabulary, an untied Qwen2, and a Llama with bf16 master weights, then saves each by every
recipe (the fixture's docstring lists them). Before the plugin's ``get_state_dict``, the
first recipe raised ``Cannot flatten unevenly sharded tensor`` (97) or hung silently (96).

Every folder is then loaded by plain ``AutoModelForCausalLM.from_pretrained`` in a process
that never imports the plugin: the logits equal the trained model's (fp32: within 1e-6;
they come out bitwise equal here) and the weights are the trained ones, bit for bit; its
files hold no ``lm_head.weight`` for a tied model and both entries for an untied one (read
from the safetensors headers), and the loaded head is the embedding's tensor only if tied.
``fsdp-overlap export`` of the run's ``save_state`` folders gives the same files as the in-run
export: ``save_state`` of this CPU launch writes Accelerate's FSDP2 layout, as on GPUs (the
plugin's accelerator says ``distributed_type: FSDP`` on every device), and ``save_state_gpu``
is that layout written by Accelerate's ``save_fsdp_model`` directly. And the old hang, ``save_pretrained``
under ``if accelerator.is_main_process``, now stops within 60 s naming the fix.

(``examples/hf_accelerate.py --export`` is checked in test_hf_accelerate.py, on a launch that
module makes anyway.)
"""

from __future__ import annotations

import json
import subprocess
import time

import _hf
import pytest
from _accelerate import ROOT, accelerate_launch, copy_yaml, output
from _export import assert_same_tensors, folder_tensors, load_without_plugin

pytestmark = pytest.mark.slow

FIXTURE = ROOT / "tests" / "fixtures" / "export_accelerate.py"
MODELS = ["llama:97:fp32", "llama:96:fp32", "qwen2:97:fp32", "llama:97:bf16"]
RECIPES = ["get_state_dict", "save_model", "save_pretrained", "plugin"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("export_accelerate")
    yaml_path = copy_yaml(root / "overlap.yaml", fsdp_overlap_backend="aot_eager")
    start = time.perf_counter()
    proc = accelerate_launch(yaml_path, str(root / "out"), *MODELS, script=FIXTURE)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, output(proc)[-6000:]
    out = root / "out"
    folders = {
        f"{spec}/{recipe}": (out / spec.replace(":", "_") / recipe, out / spec.replace(":", "_") / "reference.pt")
        for spec in MODELS
        for recipe in RECIPES
    }
    loaded = load_without_plugin(folders, root)
    print(f"accelerate export run: {seconds:.0f} s")
    return {"root": out, "loaded": loaded, "text": output(proc)}


def test_get_state_dict_gives_full_cpu_tensors_on_the_main_process_only(run):
    for spec in MODELS:
        family = spec.split(":")[0]
        main, other = json.loads((run["root"] / spec.replace(":", "_") / "contract.json").read_text())
        assert main["types"] == ["Tensor"] and main["devices"] == ["cpu"] and main["full_shapes"], main
        assert main["entries"] == (21 if family == "llama" else 27)
        assert main["head"] == ("the embedding" if _hf.TIED[family] else "its own tensor"), main
        assert other["entries"] == 0  # Accelerate's FSDP2 contract: {} off the main process


@pytest.mark.parametrize("spec", MODELS)
def test_every_recipe_loads_with_plain_from_pretrained(run, spec):
    assert run["loaded"]["plugin imported"] is False
    family = spec.split(":")[0]
    for recipe in RECIPES:
        got = run["loaded"][f"{spec}/{recipe}"]
        assert got["same_weights"], (spec, recipe)  # the head's trained values included
        # the files: a tied head left out, an untied one stored (read from the files, not config.json)
        assert _hf.head_storage_problems(run["root"] / spec.replace(":", "_") / recipe, family) == []
        # loaded: the head is the embedding's tensor (tied) or its own (untied)
        assert got["head_is_embedding"] is got["head_shares_data"] is _hf.TIED[family], (spec, recipe, got)
        if spec.endswith("fp32"):
            assert got["logits"] <= 1e-6 and got["dtypes"] == ["torch.float32"], (spec, recipe, got)
        else:  # bf16 weights, bf16 compute: the same weights give the same logits up to bf16 rounding
            assert got["logits"] <= 5e-2 and got["dtypes"] == ["torch.bfloat16"], (spec, recipe, got)


@pytest.mark.parametrize("spec", MODELS)
def test_recipes_write_the_same_tensors(run, spec):
    folder = run["root"] / spec.replace(":", "_")
    plugin = folder_tensors(folder / "plugin")
    assert len(json.loads((folder / "plugin" / "model.safetensors.index.json").read_text())["weight_map"]) == len(
        plugin
    )
    for recipe in ("get_state_dict", "save_pretrained"):
        assert_same_tensors(folder_tensors(folder / recipe), plugin)
    saved = folder_tensors(folder / "save_model")  # Accelerate's own writer: tied weight under its first name
    assert_same_tensors(saved, plugin)


@pytest.mark.parametrize("spec", ["llama:97:fp32", "qwen2:97:fp32", "llama:97:bf16"])
@pytest.mark.parametrize("state", ["save_state", "save_state_gpu"])
def test_export_cli_turns_save_state_into_the_same_files(run, spec, state, tmp_path):
    """save_state writes every model the Accelerator prepared: the i-th as pytorch_model_fsdp_i/
    (model 0: the folder itself). save_fsdp_model was called for one model, index 0."""
    folder = run["root"] / spec.replace(":", "_")
    index = MODELS.index(spec)
    source = (
        folder / state if index == 0 or state == "save_state_gpu" else folder / state / f"pytorch_model_fsdp_{index}"
    )
    cli = ROOT / ".venv" / "bin" / "fsdp-overlap"
    command = [str(cli) if cli.exists() else "fsdp-overlap", "export", str(source), str(tmp_path / "out")]
    proc = subprocess.run([*command, "--model", f"hf:{folder / 'plugin'}"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    kind = (
        "distributed checkpoint (DCP)"
        if source.name.startswith("pytorch_model_fsdp")
        else "Accelerate save_state (sharded)"
    )
    assert f"read   {kind}" in proc.stdout, proc.stdout
    assert "models' weights" not in proc.stdout  # one model in the folder, or its own file
    assert_same_tensors(folder_tensors(tmp_path / "out"), folder_tensors(folder / "plugin"))
    assert _hf.head_storage_problems(tmp_path / "out", spec.split(":")[0]) == []
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == json.loads((folder / "plugin" / "config.json").read_text())


def test_a_save_state_folder_of_several_models_says_which_it_reads(run, tmp_path):
    folder = run["root"] / MODELS[-1].replace(":", "_") / "save_state"  # saved with all four prepared
    cli = ROOT / ".venv" / "bin" / "fsdp-overlap"
    command = [str(cli) if cli.exists() else "fsdp-overlap", "export", str(folder), str(tmp_path / "out"), "--json"]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    notes = json.loads(proc.stdout)["checkpoint"]["notes"]
    assert notes == [
        f"{folder} holds 4 models' weights; this is model 0 (pytorch_model_fsdp_0). To export another, pass its "
        "file or folder: pytorch_model_fsdp_1, pytorch_model_fsdp_2, pytorch_model_fsdp_3"
    ]


def test_saving_on_the_main_process_only_stops_within_60_s_naming_the_fix(tmp_path):
    """Before: rank 0 waited in an all-gather only it had started, rank 1 in a barrier, at
    0% CPU for gloo's 30 minutes. Now rank 0's arrival check gives up after
    rank_check_timeout (10 s here: rank 1 never arrives, so a longer wait would only idle)
    with the fix in the message, and the launcher stops."""
    yaml_path = copy_yaml(
        tmp_path / "overlap.yaml", fsdp_overlap_backend="aot_eager", fsdp_overlap_rank_check_timeout=10
    )
    start = time.perf_counter()
    script = ROOT / "tests" / "fixtures" / "export_hang.py"
    proc = accelerate_launch(yaml_path, str(tmp_path / "out"), script=script, timeout=120)
    seconds = time.perf_counter() - start
    text = output(proc)
    assert proc.returncode != 0 and seconds < 60, (seconds, text[-3000:])
    assert "only 1 of 2 ranks reached the save_pretrained call within 10 s (rank_check_timeout)" in text, text[-3000:]
    assert "call it outside `if accelerator.is_main_process:`" in text
    assert not (tmp_path / "out" / "model.safetensors").exists()
    print(f"main-process-only save_pretrained stopped after {seconds:.0f} s")
