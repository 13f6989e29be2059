"""``push_tensors``: full checkpoint tensors from plain, PEFT and FSDP2-sharded models, merged copies only."""

import copy

import pytest
import torch

from trl_gptoss.rollout import push_tensors
from trl_gptoss.rollout.weights.push import PushStats, push_layers, pushed_layout
from trl_gptoss.testing import tiny_gpt_oss

from ._push_workers import LORA_TARGETS, build, push_rank

peft = pytest.importorskip("peft")


def lora_model():
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **LORA_TARGETS)
    return peft.get_peft_model(tiny_gpt_oss(seed=0, initializer_range=0.15), config)


def test_plain_model_yields_its_parameters_under_checkpoint_names_without_copies():
    model = tiny_gpt_oss(seed=0)
    pushed = dict(push_tensors(model))
    assert list(pushed) == [n for n, _ in model.named_parameters()]
    for name, tensor in pushed.items():
        assert tensor.data_ptr() == model.get_parameter(name).data_ptr(), name  # no cast, no merge: no copy


def test_lora_push_equals_peft_merge_and_leaves_adapters_trainable():
    model = lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    lora = [n for n, p in model.named_parameters() if "lora_" in n and p.requires_grad]
    pushed = {n: t.clone() for n, t in push_tensors(model)}
    assert sorted(pushed) == sorted(merged)
    assert [n for n in merged if not torch.equal(pushed[n], merged[n])] == []
    assert [n for n, p in model.named_parameters() if not torch.equal(p, before[n])] == []  # nothing merged in
    assert not any(getattr(m, "merged", False) for m in model.modules())
    assert len(lora) == 24 and any("experts" in n for n in lora) and any("q_proj" in n for n in lora)
    after = [n for n, p in model.named_parameters() if "lora_" in n and p.requires_grad]
    assert after == lora
    ids = torch.tensor([[5, 40, 41, 42, 7]])
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(model.get_parameter(n).grad is not None and model.get_parameter(n).grad.abs().sum() > 0 for n in lora)
    # the merge matters: adapted weights differ from the base ones
    assert not torch.equal(
        pushed["model.layers.0.mlp.experts.gate_up_proj"],
        before["base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj"],
    )


def test_dtype_select_and_receiving_rank():
    model = lora_model()
    merged = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    sinks = dict(push_tensors(model, dtype=torch.bfloat16, select=lambda n: n.endswith("sinks") or "q_proj" in n))
    assert sorted(sinks) == sorted(n for n in merged if n.endswith("sinks") or "q_proj" in n)
    for name, tensor in sinks.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, merged[name].to(torch.bfloat16)), name
    assert list(push_tensors(model, to_rank=1)) == []  # this (only) process is rank 0
    assert pushed_layout(model) == {n: list(p.shape) for n, p in merged.items()}


def test_layers_come_one_at_a_time_within_one_layer_of_memory():
    model = lora_model()
    stats = PushStats()
    keys = []
    for layer in push_layers(model, stats=stats):
        keys.append({n.split(".")[2] if n.startswith("model.layers.") else "-" for n, _ in layer})
        del layer  # a loop variable keeps the last layer alive while the next one is gathered
    assert [len(k) for k in keys] == [1] * len(keys) and len(keys) == 4  # embeddings, layer 0, layer 1, head
    assert stats.live_bytes == 0 and 0 < stats.peak_bytes <= stats.max_layer_bytes


def test_deepspeed_zero3_parameters_are_refused_naming_the_alternative():
    model = tiny_gpt_oss(seed=0)
    model.model.layers[0].self_attn.q_proj.weight.ds_id = 7  # what ZeRO-3 puts on its partitioned parameters
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight.*ZeRO-3.*FSDP2"):
        next(push_tensors(model))


@pytest.mark.distributed
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fsdp2_push_gathers_exact_full_tensors_on_rank0_only(tmp_path, lora):
    from trl_gptoss.testing.distributed import launch

    _, reference = build(lora)
    rank0, rank1 = launch(push_rank, 2, tmp_path / "run", lora, timeout=300)
    assert rank0["received"] and sorted(rank0["received"]) == rank0["expected"] == sorted(reference)
    assert rank0["mismatched"] == [], "gathered (merged) tensors differ from the unsharded model's"
    assert rank1["received"] == [] and rank1["peak_bytes"] == 0
    for result in (rank0, rank1):
        assert result["changed"] == [], "the push changed a trained shard"
        assert result["lora_params"] == (24 if lora else 0) and result["lora_without_grad"] == []
    # memory: what was alive at once on rank 0 (gathered tensors held a layer at a time, merge chunks) is
    # one layer's full weights, plus at most one expert's delta when nearly the whole layer is adapted
    one_expert = 128 * 256 * 4
    assert rank0["live_after"] == 0
    assert rank0["peak_bytes"] <= rank0["max_layer_bytes"] + (one_expert if lora else 0), rank0


def test_server_checkpoint_is_a_merged_copy_and_the_adapters_keep_training(tmp_path):
    from transformers import GptOssForCausalLM

    from trl_gptoss.rollout.weights.merged_checkpoint import save_merged_checkpoint

    model = lora_model()
    lora = [n for n, p in model.named_parameters() if "lora_" in n and p.requires_grad]
    merged = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    save_merged_checkpoint(model, tmp_path)
    saved = GptOssForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert [n for n, p in saved.named_parameters() if not torch.equal(p, merged[n])] == []
    assert [n for n, p in model.named_parameters() if "lora_" in n and p.requires_grad] == lora and len(lora) == 24
    ids = torch.tensor([[5, 40, 41, 42, 7]])
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(model.get_parameter(n).grad is not None for n in lora)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.xdist_group("vllm")
def test_backend_started_for_a_lora_model_serves_the_merged_copy_and_adapters_stay(tmp_path):
    from types import SimpleNamespace

    from trl_gptoss.testing import harmony_tokenizer
    from trl_gptoss.trainer.sampling import ENGINE_KINDS

    model = lora_model()
    lora = [n for n, p in model.named_parameters() if "lora_" in n and p.requires_grad]
    args = SimpleNamespace(
        rollout_backend="vllm_server",
        rollout_server_url=None,
        rollout_max_model_len=256,
        rollout_server_timeout=900,
        routing_replay="off",
    )
    backend = ENGINE_KINDS["vllm_server"].build(args, model, harmony_tokenizer())
    try:
        sequence = [5, 40, 41, 42, 7, 300, 301, 17, 99, 100]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([sequence])).logits[0, :-1].double()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(sequence[1:])[:, None]).squeeze(1)
        served = torch.tensor(backend.engine.score(sequence), dtype=torch.float64)
        assert (served - expected).abs().max() <= 1e-4  # the server started from the merged copy
        backend.engine.push_weights(model)
        assert [n for n, p in model.named_parameters() if "lora_" in n and p.requires_grad] == lora
        ids = torch.tensor([sequence])
        model(input_ids=ids, labels=ids).loss.backward()
        assert all(model.get_parameter(n).grad is not None for n in lora) and len(lora) == 24
    finally:
        backend.engine.close()
        backend.release()


@pytest.mark.distributed
@pytest.mark.parametrize("fail_at_layer", [None, 1], ids=["ok", "rank0-fails-mid-push"])
def test_push_model_is_collective_and_a_failure_on_rank0_reaches_every_rank(tmp_path, fail_at_layer):
    from trl_gptoss.testing.distributed import launch

    from ._push_workers import push_model_rank

    rank0, rank1 = launch(push_model_rank, 2, tmp_path / "run", fail_at_layer, timeout=300)
    assert rank0["built"] == 1 and rank1["built"] == 0  # only the pushing rank talks to servers
    if fail_at_layer is None:
        assert rank0["error"] is rank1["error"] is None
        assert rank0["layers"] == 4 and rank0["mismatched"] == []
    else:
        assert rank0["error"] == "ConnectionError: rollout server went away" and rank0["aborted"]
        assert rank1["error"] == "RuntimeError: weight push failed on rank 0; its log has the error"
        assert rank0["layers"] == fail_at_layer
