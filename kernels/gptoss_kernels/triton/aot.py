"""Ahead-of-time compile of the sink-attention kernels for a CUDA architecture, on a machine without a GPU.

The CPU interpreter proves the math but not that the kernels lower to PTX: it accepts constructs the
compiler rejects (non-constexpr globals, dtype mixes in ``tl.dot``, shared-memory overflows). This runs the
real Triton pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin via the bundled ptxas) with the launchers'
own tile sizes and compile-time arguments. Needs ``TRITON_INTERPRET`` unset when triton is imported::

    python -m gptoss_kernels.triton.aot --arch 90 --dtype bf16 --window 128
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gptoss_kernels.triton.backward import _sink_attention_bwd_dkdv_kernel, _sink_attention_bwd_dq_kernel
from gptoss_kernels.triton.forward import _sink_attention_fwd_kernel
from gptoss_kernels.triton.launchers import INTERPRETED, kernel_meta, launch_config, padded_head_dim
from gptoss_kernels.triton.preprocess import _sink_attention_bwd_preprocess_kernel

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_FP32_POINTERS = ("SINKS", "LSE", "DELTA", "DSINK_ROWS")


def _signature(kernel, dtype_name, constexprs):
    """Triton type strings: tensors of the input dtype, fp32 statistics, int32 offsets and strides."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in _FP32_POINTERS:
            signature[name] = "*fp32"
        elif name in ("CU_SEQLENS", "CU_SEQLENS_K"):
            signature[name] = "*i32"
        elif name.isupper():
            signature[name] = f"*{dtype_name}"
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
    return signature


def _compile(kernel, dtype_name, constexprs, options, arch):
    source = ASTSource(kernel, _signature(kernel, dtype_name, constexprs), constexprs=constexprs)
    start = time.perf_counter()
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return {
        "kernel": kernel.fn.__name__,
        "shared_bytes": compiled.metadata.shared,
        "num_warps": options.get("num_warps", 4),
        "compile_s": round(time.perf_counter() - start, 2),
        "has_cubin": bool(compiled.asm.get("cubin")),
    }


def compile_all(arch=90, dtype="bf16", window=None, num_heads=64, num_kv_heads=8, head_dim=64):
    """Compile the four kernels exactly as the launchers would launch them; returns one record per kernel."""
    if INTERPRETED:
        raise ValueError("TRITON_INTERPRET=1 was set when triton was imported; run this in a fresh process")
    records = []
    for backward, kernels in (
        (False, (_sink_attention_fwd_kernel,)),
        (True, (_sink_attention_bwd_dq_kernel, _sink_attention_bwd_dkdv_kernel)),
    ):
        config = launch_config("cuda", padded_head_dim(head_dim), backward=backward, dtype=_DTYPES[dtype])
        meta = kernel_meta(_DTYPES[dtype], num_heads // num_kv_heads, head_dim, window is not None, config)
        options = {key: meta.pop(key) for key in ("num_warps", "num_stages")}
        for kernel in kernels:
            heads = {"NUM_KV_HEADS": num_kv_heads} if "NUM_KV_HEADS" in kernel.arg_names else {"NUM_HEADS": num_heads}
            records.append(_compile(kernel, dtype, {**meta, **heads}, options, arch))
    preprocess = {"HEAD_DIM": padded_head_dim(head_dim), "BLOCK_T": 64}
    records.append(_compile(_sink_attention_bwd_preprocess_kernel, dtype, preprocess, {"num_warps": 4}, arch))
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 or 90")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)
    records = compile_all(args.arch, args.dtype, args.window, head_dim=args.head_dim)
    json.dump(records, sys.stdout)
    print()


if __name__ == "__main__":
    main()
