"""A tiny GPT-OSS written in the hub's MXFP4 layout, and the float model it encodes.

The hub tensors come first: random ``uint8`` blocks (every byte value, so every code in both nibbles) and E8M0
scales. The float model's expert weights are decoded from them here, in float64 with numpy and none of the
package's code, so they are exactly representable in MXFP4 and in bfloat16.
Hub layout, as ``openai/gpt-oss-20b`` ships it: shards ``model-0000k-of-0000N.safetensors`` (numbered from 0)
with an index, expert projections as ``{gate_up_proj,down_proj}_{blocks,scales}`` (``uint8 [E, R, G, 16]`` /
``[E, R, G]``) next to bf16 biases, every other tensor bf16, and ``quantization_config`` in config.json.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.testing.tokenizers import harmony_tokenizer

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)
PROJECTIONS = ("gate_up_proj", "down_proj")
QUANTIZATION_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


def decode_reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Hub ``blocks [E, R, G, 16]``, ``scales [E, R, G]`` -> float64 ``[E, C, R]`` (transformers' layout)."""
    high, low = np.divmod(blocks.astype(np.int64), 16)
    codes = np.stack([low, high], axis=-1).reshape(*blocks.shape[:-1], 32)  # low nibble is the earlier element
    values = E2M1[codes] * np.exp2(scales.astype(np.float64) - 127)[..., None]
    experts, rows, groups = scales.shape
    return values.reshape(experts, rows, groups * 32).transpose(0, 2, 1)


def random_mxfp4(shape_erc, generator: np.random.Generator, exponents=(-10, -3)):
    """Random hub blocks/scales for a ``[E, R, C]`` projection; scales ``2**k`` with ``k`` in ``exponents``."""
    experts, rows, cols = shape_erc
    blocks = generator.integers(0, 256, size=(experts, rows, cols // 32, 16), dtype=np.uint8)
    scales = generator.integers(127 + exponents[0], 127 + exponents[1] + 1, size=(experts, rows, cols // 32))
    return blocks, scales.astype(np.uint8)


def representable_model(seed: int = 0, **overrides):
    """A tiny bf16 GPT-OSS whose experts are MXFP4-exact; returns ``(model, {hub_name: uint8 tensor})``."""
    model = tiny_gpt_oss(seed=seed, dtype=torch.bfloat16, **overrides)
    generator = np.random.default_rng(seed)
    hub = {}
    for layer, decoder in enumerate(model.model.layers):
        experts = decoder.mlp.experts
        for proj in PROJECTIONS:
            param = getattr(experts, proj)  # [E, C, R]
            blocks, scales = random_mxfp4((param.shape[0], param.shape[2], param.shape[1]), generator)
            with torch.no_grad():
                param.copy_(torch.from_numpy(decode_reference(blocks, scales)))
            stem = f"model.layers.{layer}.mlp.experts.{proj}"
            hub[f"{stem}_blocks"], hub[f"{stem}_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
    return model, hub


def write_hub_checkpoint(path: Path, model, hub: dict, *, shards: int = 3, split_pair: bool = True) -> Path:
    """Write ``model`` in the hub layout: experts as ``hub``'s blocks/scales, the rest bf16, over ``shards`` files.

    Tensors go to shards in name order; with ``split_pair`` the last layer's ``down_proj_scales`` is moved
    to another shard than its blocks (the converter must find it there).
    """
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(tuple(f"experts.{p}" for p in PROJECTIONS))}
    state = {**{k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, **hub}
    names = sorted(state)
    files = [f"model-{k:05d}-of-{shards - 1:05d}.safetensors" for k in range(shards)]
    weight_map = {name: files[i * shards // len(names)] for i, name in enumerate(names)}
    if split_pair:
        moved = f"model.layers.{len(model.model.layers) - 1}.mlp.experts.down_proj_scales"
        blocks_file = weight_map[moved.replace("_scales", "_blocks")]
        weight_map[moved] = files[0] if blocks_file != files[0] else files[-1]
    for file in files:
        save_file({n: state[n] for n in names if weight_map[n] == file}, str(path / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = model.config.to_dict()
    config.update(architectures=["GptOssForCausalLM"], quantization_config=QUANTIZATION_CONFIG, dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(path)
    harmony_tokenizer(small=True).save_pretrained(path)
    return path


def copy_hub_with(hub_dir, tmp_path, *, config=None, tensors=None, truncate=None):
    """A copy of the hub checkpoint with config keys replaced (None deletes) and tensors replaced (None deletes)."""
    copy = shutil.copytree(hub_dir, tmp_path / "corrupt")
    if config:
        data = json.loads((copy / "config.json").read_text())
        for key, value in config.items():
            data.pop(key) if value is None else data.__setitem__(key, value)
        (copy / "config.json").write_text(json.dumps(data))
    index_path = copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for name, value in (tensors or {}).items():
        file = copy / index["weight_map"][name]
        shard = load_file(file)
        if value is None:
            del shard[name], index["weight_map"][name]
        else:
            shard[name] = value
        save_file(shard, str(file), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    if truncate:
        file = copy / index["weight_map"][truncate]
        os.truncate(file, file.stat().st_size - 100)
    return copy


@pytest.fixture(scope="module")
def float_and_hub(tmp_path_factory):
    """``(float bf16 model, hub checkpoint directory)`` shared by a module's tests."""
    model, hub = representable_model(seed=0)
    return model, write_hub_checkpoint(tmp_path_factory.mktemp("hub-mxfp4"), model, hub)
