"""The ``convert`` subcommand of the ``trl-gptoss`` console script (imports torch only when it runs).

``trl-gptoss convert SRC DST [--dtype bfloat16] [--max-shard-gib 5]``: SRC is an MXFP4 GPT-OSS checkpoint
directory or a hub id (``openai/gpt-oss-20b``); DST a new or empty directory.
"""

from __future__ import annotations

import argparse
import sys

MIN_SHARD_GIB, MAX_SHARD_GIB = 2**-10, 2**10  # 1 MiB .. 1 TiB


def _shard_gib(text: str) -> float:
    """``--max-shard-gib``: a finite size between 1 MiB and 1 TiB (``1e-12`` would write nothing, ``inf`` overflows)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-shard-gib must be a number of GiB, got {text!r}") from None
    if not MIN_SHARD_GIB <= value <= MAX_SHARD_GIB:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(
            f"--max-shard-gib must be between {MIN_SHARD_GIB} (1 MiB) and {MAX_SHARD_GIB} (1 TiB), got {text}"
        )
    return value


def _cmd_convert(args) -> int:
    from trl_gptoss.checkpoint import CheckpointError, convert_checkpoint

    try:
        result = convert_checkpoint(
            args.src,
            args.dst,
            dtype=args.dtype,
            max_shard_bytes=int(args.max_shard_gib * 2**30),
            log=lambda message: print(message, file=sys.stderr, flush=True),
        )
    except CheckpointError as exc:
        print(f"trl-gptoss convert: {exc}", file=sys.stderr)
        return 2
    print(
        f"{result.destination}: {result.tensors} tensors ({result.dequantized} dequantised from MXFP4) in "
        f"{len(result.shards)} shard(s), {args.dtype}"
    )
    return 0


def register(sub) -> None:
    """Add ``convert`` to the console script's subparsers."""
    convert = sub.add_parser(
        "convert", help="MXFP4 GPT-OSS hub checkpoint -> bf16 checkpoint for training and vLLM (streaming)"
    )
    convert.add_argument("src", metavar="SRC", help="MXFP4 checkpoint directory or hub id (openai/gpt-oss-20b)")
    convert.add_argument("dst", metavar="DST", help="new or empty output directory")
    convert.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    convert.add_argument(
        "--max-shard-gib", type=_shard_gib, default=5.0, help="largest output shard; bounds the memory used (GiB)"
    )
    convert.set_defaults(func=_cmd_convert)
