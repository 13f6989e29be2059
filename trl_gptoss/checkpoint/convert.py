"""Convert an MXFP4 GPT-OSS hub checkpoint into a plain bfloat16 (or float32) one, streaming shard by shard.

The result has transformers' ``GptOssForCausalLM`` names and layouts (experts ``gate_up_proj [E, H, 2I]``,
``down_proj [E, I, H]``, see ``trl_gptoss.checkpoint.mxfp4``), a ``config.json`` without
``quantization_config``, and the source's tokenizer, chat template and generation config: the trainer
(``fa3_sink`` + ``gptoss_sequential``) and vLLM both load it, and vLLM can receive bf16 weight pushes into it.

Memory: one source shard is memory-mapped at a time, tensors are dequantised one by one (one expert's
temporaries at a time) and the writer holds at most ``max_shard_bytes`` of output before writing a shard, so
the peak stays near one output shard however large the model is. Every header, and every tensor's name, shape
and dtype against the ``GptOssForCausalLM`` that ``config.json`` describes, is validated before anything is
written, so a corrupt or foreign checkpoint fails fast with the tensor named. The output is built beside DST
under a temporary name and renamed last (``destination.py``): a failure, a full disk included, leaves no DST.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from trl_gptoss.checkpoint.destination import check_destination, staged_directory
from trl_gptoss.checkpoint.mxfp4 import MXFP4FormatError, check_mxfp4_pair, dequantize_mxfp4
from trl_gptoss.checkpoint.safetensors_files import CheckpointError, ShardWriter, TensorInfo, read_header, read_json

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
INDEX_FILE = "model.safetensors.index.json"
_EXPERT_TENSOR = re.compile(r"^(?P<module>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)_(?P<part>blocks|scales)$")
_SKIPPED_FILES = {"config.json", INDEX_FILE}
# config.json sizes the model's tensors: each must be an integer >= 1 (``true`` is not one); the first four
# are required, the others take transformers' defaults when absent.
_REQUIRED_SIZES = ("num_local_experts", "hidden_size", "intermediate_size", "num_hidden_layers")
_OPTIONAL_SIZES = ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts_per_tok")


@dataclass(frozen=True)
class ExpertPair:
    """The hub tensors of one MXFP4 expert projection and the name and shape it is written under."""

    output_name: str
    output_shape: tuple[int, int, int]  # [E, C, R], transformers' layout
    blocks: TensorInfo
    scales: TensorInfo


@dataclass(frozen=True)
class ConversionResult:
    destination: Path
    shards: tuple[str, ...]
    tensors: int
    dequantized: int
    total_bytes: int
    peak_buffered_bytes: int


def resolve_source(src: str | Path) -> Path:
    """A local checkpoint directory as is; ``owner/name`` (not a local path) -> its hub snapshot, top level only.

    The hub repositories also carry ``original/`` and ``metal/`` copies of the weights; those are not fetched.
    """
    path = Path(src)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"SRC {src} is a file; pass the checkpoint directory (config.json + *.safetensors)")
    if str(src).count("/") != 1 or str(src).startswith(("/", ".")):
        raise CheckpointError(
            f"SRC {src} does not exist; pass a checkpoint directory or a hub id like openai/gpt-oss-20b"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(src), ignore_patterns=["*/*"]))
    except Exception as exc:  # offline, unknown repository, no access: all reported the same way
        message = f"SRC {src} is not a local directory and could not be fetched from the hub: {exc}"
        raise CheckpointError(message) from exc


def read_mxfp4_config(src: Path) -> dict:
    """``config.json`` of an MXFP4 GPT-OSS checkpoint; refuses other models and unquantised checkpoints."""
    config_path = src / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{src} has no config.json; SRC must be a checkpoint directory")
    config = read_json(config_path, "config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: not a JSON object")
    if config.get("model_type") != "gpt_oss":
        raise CheckpointError(
            f"{config_path}: model_type is {config.get('model_type')!r}, not 'gpt_oss'; only GPT-OSS checkpoints "
            "can be converted"
        )
    quantization = config.get("quantization_config")
    if quantization is not None and not isinstance(quantization, dict):
        raise CheckpointError(f"{config_path}: quantization_config is not a JSON object")
    if quantization is None:
        raise CheckpointError(
            f"{config_path} has no quantization_config: the checkpoint is not MXFP4, so there is nothing to "
            "convert; train and serve it as it is"
        )
    if quantization.get("quant_method") != "mxfp4":
        raise CheckpointError(
            f"{config_path}: quantization_config.quant_method is {quantization.get('quant_method')!r}, not "
            "'mxfp4'; only MXFP4 checkpoints can be converted"
        )
    for key in _REQUIRED_SIZES + _OPTIONAL_SIZES:
        value = config.get(key)
        if value is None and key in _OPTIONAL_SIZES:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"{config_path}: {key} must be an integer >= 1, got {str(value)[:50]}")
    return config


def list_tensors(src: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint (one ``model.safetensors`` or the shards its index names), validated."""
    index_path = src / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path, "index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path} has no weight_map")
        for name, file in weight_map.items():
            if not isinstance(file, str) or file in ("", ".", "..") or Path(file).name != file:
                raise CheckpointError(
                    f"{index_path} maps tensor {name} to {str(file)[:100]!r}, which is not a file name in {src}"
                )
        files = sorted(set(weight_map.values()))
    elif (src / "model.safetensors").is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        raise CheckpointError(f"{src} has neither {INDEX_FILE} nor model.safetensors")
    tensors = {}
    for file in files:
        if not (src / file).is_file():
            raise CheckpointError(f"{index_path} names the shard {file}, which is missing from {src}")
        for name, info in read_header(src / file).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name} is stored twice: in {tensors[name].file.name} and {file}")
            tensors[name] = info
    for name, file in (weight_map or {}).items():
        if name not in tensors or tensors[name].file.name != file:
            raise CheckpointError(f"{index_path} maps tensor {name} to {file}, which does not hold it")
    return tensors


def plan_experts(tensors: dict[str, TensorInfo], config: dict) -> dict[str, ExpertPair]:
    """Blocks tensor name -> its ``ExpertPair``; checks pairing, dtypes and shapes against ``config``."""
    experts, hidden, inner = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    if config["num_hidden_layers"] > len(tensors):  # every layer has tensors; also bounds the loops below
        raise CheckpointError(
            f"config.json says num_hidden_layers={config['num_hidden_layers']} but the checkpoint holds only "
            f"{len(tensors)} tensors"
        )
    expected = {"gate_up_proj": (experts, 2 * inner, hidden), "down_proj": (experts, hidden, inner)}
    plan = {}
    for name, info in tensors.items():
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            if name.endswith(("_blocks", "_scales")) and info.dtype == "U8":
                raise CheckpointError(f"tensor {name} looks like MXFP4 but is not a GPT-OSS expert projection")
            continue
        stem = f"{match['module']}.{match['proj']}"
        partner = f"{stem}_scales" if match["part"] == "blocks" else f"{stem}_blocks"
        if partner not in tensors:
            raise CheckpointError(f"tensor {name} has no {partner} (each MXFP4 projection needs blocks and scales)")
        if stem in tensors:
            raise CheckpointError(f"tensor {stem} is stored both as MXFP4 ({name}) and unquantised")
        if match["part"] == "scales":
            continue
        scales = tensors[partner]
        try:
            shape = check_mxfp4_pair(stem, info.shape, info.dtype, scales.shape, scales.dtype)
        except MXFP4FormatError as exc:
            raise CheckpointError(str(exc)) from None
        if shape != expected[match["proj"]]:
            raise CheckpointError(
                f"tensor {name} dequantises to [experts, rows, cols] = {list(shape)}, but config.json needs "
                f"{list(expected[match['proj']])} for {match['proj']}"
            )
        plan[name] = ExpertPair(stem, (shape[0], shape[2], shape[1]), info, scales)
    if not plan:
        raise CheckpointError("config.json says MXFP4 but no tensor ends in _blocks: there is nothing to dequantise")
    for layer in range(config["num_hidden_layers"]):
        for proj in expected:
            stem = f"model.layers.{layer}.mlp.experts.{proj}"
            if f"{stem}_blocks" not in tensors and stem not in tensors:
                raise CheckpointError(
                    f"tensor {stem}_blocks is missing (layer {layer} of {config['num_hidden_layers']})"
                )
    return plan


def model_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the ``GptOssForCausalLM`` that ``config`` describes (built on meta)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    values = {key: value for key, value in config.items() if key != "quantization_config"}
    try:
        with torch.device("meta"):
            model = GptOssForCausalLM(GptOssConfig(**values))
    except Exception as exc:  # any config transformers cannot build a model from
        message = f"config.json does not describe a GptOssForCausalLM transformers can build: {str(exc)[:300]}"
        raise CheckpointError(message) from None
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def check_against_model(tensors: dict[str, TensorInfo], plan: dict[str, ExpertPair], config: dict) -> None:
    """Every output tensor is a parameter of the model ``config`` describes, with its shape, and none is missing."""
    scale_names = {pair.scales.name for pair in plan.values()}
    output = {pair.output_name: pair.output_shape for pair in plan.values()}
    for name, info in tensors.items():
        if name in plan or name in scale_names:
            continue
        if not info.is_floating_point:
            raise CheckpointError(f"tensor {name} has dtype {info.dtype}; a GptOssForCausalLM parameter is floating")
        output[name] = info.shape
    expected = model_parameters(config)
    for name, shape in sorted(output.items()):
        if name not in expected:
            raise CheckpointError(
                f"tensor {name} is not a parameter of GptOssForCausalLM with this config.json "
                f"(num_hidden_layers={config['num_hidden_layers']})"
            )
        if shape != expected[name]:
            raise CheckpointError(
                f"tensor {name} has shape {list(shape)}, but config.json needs {list(expected[name])}"
            )
    tied = config.get("tie_word_embeddings") is True
    missing = sorted(set(expected) - set(output) - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise CheckpointError(f"tensor {missing[0]} is missing ({len(missing)} parameter(s) of the model are absent)")


def _stream(tensors, plan, writer: ShardWriter, dtype: torch.dtype, log: Callable[[str], None]) -> int:
    """Write every output tensor, one source shard open at a time; returns how many were dequantised."""
    scale_names = {pair.scales.name for pair in plan.values()}
    files = sorted({info.file for info in tensors.values()})
    dequantized = 0
    for number, file in enumerate(files, start=1):
        names = sorted(name for name, info in tensors.items() if info.file == file and name not in scale_names)
        with safe_open(str(file), framework="pt") as shard:
            for name in names:
                writer.make_room(_output_bytes(tensors[name], plan.get(name), dtype))
                if name in plan:
                    pair = plan[name]
                    scales = _load(pair.scales, shard if pair.scales.file == file else None)
                    weight = dequantize_mxfp4(shard.get_tensor(name), scales, dtype=dtype, name=pair.output_name)
                    writer.add(pair.output_name, weight)
                    dequantized += 1
                else:
                    tensor = shard.get_tensor(name)
                    writer.add(name, tensor.to(dtype) if tensor.is_floating_point() else tensor)
        log(f"[{number}/{len(files)}] {file.name}: {len(names)} tensors")
    return dequantized


def _output_bytes(info: TensorInfo, pair: ExpertPair | None, dtype: torch.dtype) -> int:
    if pair is not None:
        return math.prod(pair.output_shape) * dtype.itemsize
    return math.prod(info.shape) * dtype.itemsize if info.is_floating_point else info.nbytes


def _load(info: TensorInfo, open_shard) -> torch.Tensor:
    if open_shard is not None:
        return open_shard.get_tensor(info.name)
    with safe_open(str(info.file), framework="pt") as other:
        return other.get_tensor(info.name)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def _write_config(config: dict, dst: Path, dtype_name: str) -> None:
    config = {key: value for key, value in config.items() if key not in ("quantization_config", "torch_dtype")}
    config["dtype"] = dtype_name
    if not config.get("architectures"):  # vLLM picks its model class from this list
        config["architectures"] = ["GptOssForCausalLM"]
    _write_json(dst / "config.json", config)


def _copy_side_files(src: Path, dst: Path) -> list[str]:
    """Tokenizer files, chat template, generation config, license: every top-level file that is not a weight."""
    copied = []
    for path in sorted(src.iterdir()):
        skip = path.name in _SKIPPED_FILES or path.name.endswith(".safetensors") or path.name.startswith(".")
        if path.is_file() and not skip:
            shutil.copy2(path, dst / path.name)
            copied.append(path.name)
    return copied


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    dtype: str = "bfloat16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    log: Callable[[str], None] = lambda message: None,
) -> ConversionResult:
    """Convert the MXFP4 GPT-OSS checkpoint ``src`` (directory or hub id) into ``dst`` in ``dtype``.

    Every floating tensor is written in ``dtype`` ("bfloat16" or "float32"); experts are dequantised exactly
    (each MXFP4 value is representable in both). Raises ``CheckpointError`` naming the file or tensor for a
    non-GPT-OSS, non-MXFP4 or corrupt checkpoint or an unusable DST, before anything is written; a failure
    while writing (a full disk, values found corrupt while streaming) removes what was written and raises
    ``CheckpointError`` too, leaving no DST.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be an integer >= 1, got {max_shard_bytes!r}")
    src = resolve_source(src)
    config = read_mxfp4_config(src)
    tensors = list_tensors(src)
    plan = plan_experts(tensors, config)
    check_against_model(tensors, plan, config)
    dst = check_destination(Path(dst))
    with staged_directory(dst) as stage:
        writer = ShardWriter(stage, max_shard_bytes)
        try:
            dequantized = _stream(tensors, plan, writer, DTYPES[dtype], log)
        except MXFP4FormatError as exc:  # valid headers, invalid values (e.g. NaN scales): found while streaming
            raise CheckpointError(str(exc)) from None
        weight_map = writer.finish()
        if len(set(weight_map.values())) > 1:
            index = {"metadata": {"total_size": writer.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            _write_json(stage / INDEX_FILE, index)
        _write_config(config, stage, dtype)
        copied = _copy_side_files(src, stage)
    size = f"{writer.total_bytes / 2**30:.2f} GiB"
    log(f"wrote {len(weight_map)} tensors ({size}) and {', '.join(copied) or 'no side files'}")
    return ConversionResult(
        dst,
        tuple(sorted(set(weight_map.values()))),
        len(weight_map),
        dequantized,
        writer.total_bytes,
        writer.peak_buffered_bytes,
    )
