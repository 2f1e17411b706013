"""benchmarks/step_time.py: the hf-llama model choice and the per-mode peak memory
measurement (``--memory``). In-process checks are cheap; the 2-rank runs are slow."""

from __future__ import annotations

import json

import _bench
import pytest

step_time = _bench.load("step_time")
models = _bench.load("_harness.models")
memory = _bench.load("_harness.memory")


def test_help_lists_the_new_flags():
    text = _bench.help_text("step_time")
    assert "hf-llama" in text and "--memory" in text and "--plan" in text


def test_hf_llama_builder_is_a_seeded_sdpa_llama_the_size_of_the_gpt():
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    model = models.build_model("hf-llama", "small")
    again = models.build_model("hf-llama", "small")
    gpt = models.build_model("gpt", "small")
    assert isinstance(model, LlamaForCausalLM) and model.training
    assert model.config._attn_implementation == "sdpa" and not model.config.tie_word_embeddings
    hidden, layers, heads, kv, inter, vocab, seq = models.HF_LLAMA_SIZES["small"]
    assert len(model.model.layers) == layers and model.config.vocab_size == vocab
    n = sum(p.numel() for p in model.parameters())
    assert 0.9 < n / sum(p.numel() for p in gpt.parameters()) < 1.1  # the GPT small's size
    assert all((a == b).all() for a, b in zip(model.parameters(), again.parameters()))  # same on every rank
    assert models.block_plan("hf-llama", model) == [[f"model.layers.{i}"] for i in range(layers)]
    assert step_time.vocab_and_seq("hf-llama", "small") == (vocab, seq)
    assert "LlamaForCausalLM" in step_time.describe_model("hf-llama", "small")


def test_hf_llama_eager_step_gives_the_models_own_loss():
    pytest.importorskip("transformers")
    import torch

    model = models.build_hf_llama(32, 2, 4, 2, 64, 64, 16)
    runner = step_time.ModelRunner(model, world=1, loss=models.loss_for("hf-llama", model))
    batch = step_time._data(64, 16, 1, 1)[0]
    x = batch[0][: step_time.BATCH_PER_RANK]
    with torch.no_grad():
        expected = model(input_ids=x, labels=x).loss.item()
    assert runner.step(batch) == pytest.approx(expected)
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)


def test_step_allocation_peak_is_the_running_sums_maximum_in_time_order():
    events = [(3, -50), (1, 100), (2, 30), (5, 10), (4, -80)]  # unordered, as several threads report them
    assert memory.step_allocation_peak(events) == (130, 10)
    assert memory.step_allocation_peak([]) == (0, 0)


def test_measure_step_memory_counts_parameters_gradients_and_activations():
    import torch

    from fsdp_overlap_plugin.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32))
    runner = step_time.ModelRunner(model, world=1, loss=models.loss_for("gpt", model))
    data = step_time._data(64, 16, 1, 4)
    runner.step(data[0])
    mem = step_time.measure_step_memory(runner, data[1:], lambda: None)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert mem["state_bytes"] == params  # shards of a 1-rank model: the parameters; no gradients held
    assert mem["step_peak_bytes"] > params  # every gradient exists before the optimizer step, plus activations
    assert mem["allocation_events"] > 0
    assert len(mem["rss_hwm_increase_per_step"]) == 2  # two unprofiled steps, the worst one counts
    assert mem["rss_hwm_increase_bytes"] == max(mem["rss_hwm_increase_per_step"])
    assert mem["peak_source"] == "rss"
    assert mem["peak_bytes"] == mem["state_bytes"] + mem["rss_hwm_increase_bytes"]


def test_memory_summary_takes_the_larger_rank_and_ratios_against_eager():
    def rank(state, peak):
        return {
            "memory": {
                "state_bytes": state,
                "step_peak_bytes": peak,
                "peak_bytes": state + peak,
                "rss_hwm_increase_bytes": None,
            }
        }

    mib = 2**20
    summary = step_time.summarize_memory(
        {
            "fsdp2-eager": [rank(2 * mib, 8 * mib), rank(2 * mib, 6 * mib)],
            "both": [rank(2 * mib, 3 * mib), rank(2 * mib, 4 * mib)],
        }
    )
    rows = summary["rows"]
    assert rows["fsdp2-eager"]["peak_mib"] == 10 and rows["both"]["peak_mib"] == 6
    assert rows["both"]["peak_mib_per_rank"] == [5, 6]
    assert rows["both"]["x_eager"] == pytest.approx(0.6)
    step_time.print_memory_table(summary, "header")  # formats None RSS values


def test_loss_difference_against_eager_is_reported():
    def rank(losses):
        return {"modes": {m: {"times": [1.0], "losses": ls, "peak_rss_mib": 1.0} for m, ls in losses.items()}}

    losses = {"fsdp2-eager": [2.0, 1.5], "both": [2.0, 1.5001], "comm-only": []}
    rows = step_time.summarize([rank(losses), rank(losses)], rate_bps=None)["rows"]
    assert rows["both"]["max_loss_diff_vs_eager"] == pytest.approx(1e-4)
    assert rows["comm-only"]["max_loss_diff_vs_eager"] is None


@pytest.mark.slow
def test_memory_run_of_one_mode_in_its_own_processes(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "mem.json"
    proc = _bench.smoke_run(
        "step_time", "--memory", "--model", "hf-llama", "--modes", "fsdp2-eager,comm-only", out=out, deadline=300
    )
    assert "skipped comm-only" in proc.stdout
    payload = json.loads(out.read_text())
    row = payload["summary"]["rows"]["fsdp2-eager"]
    assert row["x_eager"] == 1.0 and row["peak_mib"] > row["state_mib"] > 0
    assert row["source"] == "rss"
    # the resident-memory increase sees at least what the profiler saw on this thread,
    # less what the OS had not yet paged in: within 10% of it on this model
    for rank in payload["raw"]["fsdp2-eager"]:
        mem = rank["memory"]
        assert mem["rss_hwm_increase_bytes"] > 0.9 * mem["step_peak_bytes"]
    assert list(payload["summary"]["rows"]) == ["fsdp2-eager"]
