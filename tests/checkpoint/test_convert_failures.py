"""``trl-gptoss convert`` fails cleanly: every bad input before the first write, and no DST after any failure.

A DST that exists after a failed run looks like a checkpoint; so each case asserts that DST's parent holds
exactly what it held before (no DST, no ``.DST.partial-*`` staging directory). The full-disk case runs the CLI
for real against a file-size limit (``RLIMIT_FSIZE``: ``EFBIG``) and, where an unprivileged user and mount
namespace can mount one (``unshare -rm``), small tmpfs file systems (``ENOSPC``).
"""

import json
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from tests.checkpoint.conftest import copy_hub_with
from trl_gptoss.checkpoint import CheckpointError, convert_checkpoint
from trl_gptoss.cli import main

GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


def _only(parent, *names):
    assert sorted(p.name for p in parent.iterdir()) == sorted(names), "DST or its staging directory was left"


def _refused(source, dst, message):
    with pytest.raises(CheckpointError, match=message):
        convert_checkpoint(source, dst, max_shard_bytes=100_000)


# ---- config.json and the index --------------------------------------------------------------------------------
def _write(path, text):
    path.write_text(text)


@pytest.mark.parametrize(
    "file, text, message",
    [
        ("config.json", '{"model_type": "gpt_oss",', "config.json is not a valid JSON config"),
        ("config.json", "[1, 2]", "config.json: not a JSON object"),
        ("config.json", "[" * 100_000 + "]" * 100_000, "config.json is not a valid JSON config"),
        ("model.safetensors.index.json", "{'weight_map'", "index.json is not a valid JSON index"),
        ("model.safetensors.index.json", '{"weight_map": [1]}', "index.json has no weight_map"),
        ("model.safetensors.index.json", "[]", "index.json has no weight_map"),
        (
            "model.safetensors.index.json",
            json.dumps({"weight_map": {"lm_head.weight": "../model-00000-of-00002.safetensors"}}),
            "maps tensor lm_head.weight to '../model-00000-of-00002.safetensors', which is not a file name",
        ),
        (
            "model.safetensors.index.json",
            json.dumps({"weight_map": {"lm_head.weight": 7}}),
            "maps tensor lm_head.weight to '7', which is not a file name",
        ),
    ],
    ids=["config-truncated", "config-list", "config-deep", "index-invalid", "index-map-list", "index-list",
         "index-path-escape", "index-number"],
)  # fmt: skip
def test_invalid_json_is_refused(float_and_hub, tmp_path, file, text, message):
    source = copy_hub_with(float_and_hub[1], tmp_path)
    _write(source / file, text)
    _refused(source, tmp_path / "out", message)
    _only(tmp_path, "corrupt")


@pytest.mark.parametrize(
    "config, message",
    [
        ({"num_hidden_layers": True}, "num_hidden_layers must be an integer >= 1, got True"),
        ({"hidden_size": 0}, "hidden_size must be an integer >= 1, got 0"),
        ({"intermediate_size": 128.0}, "intermediate_size must be an integer >= 1, got 128.0"),
        ({"num_local_experts": "4"}, "num_local_experts must be an integer >= 1, got 4"),
        ({"vocab_size": -5}, "vocab_size must be an integer >= 1, got -5"),
        ({"num_hidden_layers": 10**12}, "num_hidden_layers=1000000000000 but the checkpoint holds only"),
        (
            {"num_hidden_layers": 1, "layer_types": ["sliding_attention"]},
            "tensor model.layers.1.* is not a parameter of GptOssForCausalLM",
        ),
        ({"num_hidden_layers": 1}, "layer_types"),  # transformers' own check, reported as ours
        ({"quantization_config": "mxfp4"}, "quantization_config is not a JSON object"),
        ({"vocab_size": 1024}, r"lm_head.weight has shape \[512, 128\], but config.json needs \[1024, 128\]"),
        ({"num_key_value_heads": 4}, r"k_proj.bias has shape \[\d+\], but config.json needs \[256\]"),
    ],
    ids=["layers-true", "hidden-0", "inner-float", "experts-str", "vocab-negative", "layers-huge", "layers-fewer",
         "layers-vs-layer-types",
         "quantization-str", "vocab-vs-embedding", "kv-heads-vs-k-proj"],
)  # fmt: skip
def test_config_values_are_checked(float_and_hub, tmp_path, config, message):
    _refused(copy_hub_with(float_and_hub[1], tmp_path, config=config), tmp_path / "out", message)
    _only(tmp_path, "corrupt")


# ---- every tensor against the model config.json describes -------------------------------------------------------
@pytest.mark.parametrize(
    "tensors, message",
    [
        (
            {"model.embed_tokens.weight": "extra-rows"},
            r"tensor model.embed_tokens.weight has shape \[520, 128\], but config.json needs \[512, 128\]",
        ),
        ({"model.layers.0.self_attn.sinks": torch.zeros(3, dtype=torch.bfloat16)}, "sinks has shape \\[3\\]"),
        ({"model.norm.weight": None}, "tensor model.norm.weight is missing"),
        ({"model.layers.1.self_attn.q_proj.bias": None}, "tensor model.layers.1.self_attn.q_proj.bias is missing"),
        ({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}, "model.norm.weight has dtype I32"),
        ({f"{GATE_UP}_bias": torch.zeros(4, 7, dtype=torch.bfloat16)}, "gate_up_proj_bias has shape \\[4, 7\\]"),
    ],
    ids=["embedding-rows", "sinks", "missing-norm", "missing-bias", "integer-norm", "expert-bias"],
)
def test_every_tensor_is_checked_against_the_config(float_and_hub, tmp_path, tensors, message):
    model, hub_dir = float_and_hub
    if tensors.get("model.embed_tokens.weight") == "extra-rows":  # the case: 8 extra embedding rows
        embedding = model.model.embed_tokens.weight.detach()
        tensors = {"model.embed_tokens.weight": torch.cat([embedding, embedding[:8]]).to(torch.bfloat16)}
    _refused(copy_hub_with(hub_dir, tmp_path, tensors=tensors), tmp_path / "out", message)
    _only(tmp_path, "corrupt")


def test_a_tensor_the_model_lacks_is_refused(float_and_hub, tmp_path):
    source = copy_hub_with(float_and_hub[1], tmp_path)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    shard = source / index["weight_map"]["lm_head.weight"]
    from safetensors.torch import load_file, save_file

    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.extra"] = torch.zeros(2, dtype=torch.bfloat16)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index["weight_map"]["model.layers.0.self_attn.extra"] = shard.name
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(source, tmp_path / "out", "tensor model.layers.0.self_attn.extra is not a parameter of GptOssForCausalLM")
    _only(tmp_path, "corrupt")


# ---- safetensors headers ----------------------------------------------------------------------------------------
def _edit_header(file, edit, *, append=b""):
    """Rewrite ``file``'s header with ``edit(header) -> header or raw bytes``; keep the data, append ``append``."""
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    new = edit(header)
    new = new if isinstance(new, bytes) else json.dumps(new).encode()
    file.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + length :] + append)


def _by_offset(header):
    return sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"])


def _shift_last(header, by):
    last = header[_by_offset(header)[-1]]
    last["data_offsets"] = [o + by for o in last["data_offsets"]]
    return header


def _overlap(header):
    second = header[_by_offset(header)[1]]
    second["data_offsets"] = [o - 2 for o in second["data_offsets"]]
    return header


def _set(field, value, which=0):
    def edit(header):
        header[_by_offset(header)[which]][field] = value
        return header

    return edit


@pytest.mark.parametrize(
    "edit, append, message",
    [
        (_overlap, b"", "2 bytes overlap after tensor"),
        (lambda h: _shift_last(h, 4), b"\0" * 4, "a gap of 4 bytes after tensor"),
        (lambda h: h, b"\0" * 8, "the tensors end at byte .* but the file holds .* data bytes"),
        (_set("shape", [-1, 4]), b"", r"shape \[-1, 4\] is not a list of integers >= 0"),
        (_set("shape", [2.0, 4]), b"", r"shape \[2.0, 4\] is not a list of integers >= 0"),
        (_set("data_offsets", [0.0, 8]), b"", r"data_offsets \[0.0, 8\] are not two integers >= 0"),
        (_set("data_offsets", [0]), b"", r"data_offsets \[0\] are not two integers >= 0"),
        (_set("dtype", ["BF16"]), b"", "unknown dtype"),
        (lambda h: b"[" * 200_000 + b"]" * 200_000, b"", "has a corrupt safetensors header"),
        (lambda h: {**h, "__metadata__": {"format": 1}}, b"", "__metadata__ is not text to text"),
    ],
    ids=["overlap", "gap", "trailing", "negative-dim", "float-dim", "float-offset", "one-offset", "dtype-list",
         "deep", "metadata"],
)  # fmt: skip
def test_headers_are_validated_before_the_first_write(float_and_hub, tmp_path, edit, append, message):
    source = copy_hub_with(float_and_hub[1], tmp_path)
    _edit_header(source / "model-00002-of-00002.safetensors", edit, append=append)
    _refused(source, tmp_path / "out", message)
    _only(tmp_path, "corrupt")


# ---- DST ----------------------------------------------------------------------------------------------------------
def test_unusable_destinations_are_refused(float_and_hub, tmp_path):
    _, hub_dir = float_and_hub
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    _refused(hub_dir, tmp_path / "dangling", "DST .*dangling is a dangling symlink")
    (tmp_path / "file").write_text("x")
    _refused(hub_dir, tmp_path / "file" / "out", "DST .*file/out is under .*file, which is a file")
    _refused(hub_dir, tmp_path / "file" / "a" / "b", "is under .*file, which is a file")
    _only(tmp_path, "dangling", "file")


def test_dst_appears_whole_or_not_at_all(float_and_hub, tmp_path):
    """A symlink to an empty directory and an empty directory are filled; missing parents are created, and
    removed again when the conversion fails; an interrupt mid-stream leaves nothing."""
    _, hub_dir = float_and_hub
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    convert_checkpoint(hub_dir, tmp_path / "link", max_shard_bytes=100_000)
    assert (tmp_path / "empty" / "config.json").is_file() and (tmp_path / "link").is_symlink()
    (tmp_path / "empty2").mkdir()
    convert_checkpoint(hub_dir, tmp_path / "empty2", max_shard_bytes=100_000)
    assert (tmp_path / "empty2" / "tokenizer.json").is_file()
    _only(tmp_path, "empty", "empty2", "link")

    def interrupt(message):
        raise KeyboardInterrupt  # after the first source shard was streamed and output shards written

    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(hub_dir, tmp_path / "new" / "deeper" / "out", max_shard_bytes=100_000, log=interrupt)
    _only(tmp_path, "empty", "empty2", "link")


@pytest.mark.parametrize("value", ["1e-12", "0", "-1", "inf", "nan", "1e9", "five"])
def test_max_shard_gib_must_be_finite_and_sane(float_and_hub, tmp_path, capsys, value):
    with pytest.raises(SystemExit):
        main(["convert", str(float_and_hub[1]), str(tmp_path / "out"), f"--max-shard-gib={value}"])
    assert "--max-shard-gib must be" in capsys.readouterr().err
    _only(tmp_path)


# ---- a full disk, for real ------------------------------------------------------------------------------------------
_FULL_DISK = r"""
import contextlib, io, json, os, resource, signal, subprocess, sys
from trl_gptoss.cli import main

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past RLIMIT_FSIZE a write then fails with EFBIG
unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
results = []
for case in json.loads(sys.argv[1]):
    os.makedirs(case["parent"])
    if case.get("tmpfs_bytes"):
        mount = ["mount", "-t", "tmpfs", "-o", f"size={case['tmpfs_bytes']}", "tmpfs", case["parent"]]
        subprocess.run(mount, check=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (case.get("file_bytes") or resource.RLIM_INFINITY, unlimited[1]))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["convert", case["src"], os.path.join(case["parent"], "out")])
    resource.setrlimit(resource.RLIMIT_FSIZE, unlimited)
    results.append({"rc": rc, "stderr": err.getvalue(), "left": sorted(os.listdir(case["parent"]))})
print(json.dumps(results))
"""


def _tmpfs_available(tmp_path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    command = ["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(probe)]
    ok = shutil.which("unshare") and subprocess.run(command, capture_output=True).returncode == 0
    probe.rmdir()
    return bool(ok)


def _pages(size: int) -> int:
    return -(-size // 4096) * 4096


@pytest.mark.slow
def test_a_full_disk_ends_in_a_clear_error_and_no_dst(float_and_hub, tmp_path):
    """``RLIMIT_FSIZE`` below the first output shard (EFBIG while writing weights); with tmpfs, a disk too
    small for the weights and one that holds the weights and config but not ``tokenizer.json`` (ENOSPC)."""
    _, hub_dir = float_and_hub
    reference = tmp_path / "reference"
    assert main(["convert", str(hub_dir), str(reference)]) == 0
    sizes = {p.name: p.stat().st_size for p in reference.iterdir()}
    weights = sum(size for name, size in sizes.items() if name.endswith(".safetensors"))
    before_tokenizer = sum(_pages(size) for name, size in sizes.items() if not name.startswith("tokenizer"))
    cases = [{"parent": str(tmp_path / "limited"), "src": str(hub_dir), "file_bytes": weights // 4}]
    tmpfs = _tmpfs_available(tmp_path)
    if tmpfs:
        cases += [
            {"parent": str(tmp_path / "small-disk"), "src": str(hub_dir), "tmpfs_bytes": _pages(weights // 2)},
            {"parent": str(tmp_path / "tokenizer-disk"), "src": str(hub_dir), "tmpfs_bytes": before_tokenizer + 8192},
        ]
    command = [sys.executable, "-c", _FULL_DISK, json.dumps(cases)]
    out = subprocess.run(
        ["unshare", "-rm", *command] if tmpfs else command, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    errors = ["File too large"] + ["No space left on device"] * (len(cases) - 1)
    for case, result, error in zip(cases, results, errors):
        last_line = result["stderr"].strip().splitlines()[-1]
        assert result["rc"] == 2, (case, result)
        assert last_line.startswith("trl-gptoss convert: writing ") and error in last_line, (case, last_line)
        assert "Traceback" not in result["stderr"], result["stderr"]
        assert result["left"] == [], (case, result["left"])  # no DST, no staging directory
    if tmpfs:  # the disk held the weights and config, then filled up on tokenizer.json, as the did
        assert "Error while serializing" in results[1]["stderr"], results[1]
        assert "tokenizer.json" in results[2]["stderr"].splitlines()[-1], results[2]
    else:
        pytest.skip("only RLIMIT_FSIZE ran: no unprivileged user+mount namespace for tmpfs (unshare -rm)")
