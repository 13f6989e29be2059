"""The ``check-sync`` subcommand of the ``trl-gptoss`` console script (imports torch only when it runs).

``trl-gptoss check-sync --server URL [--server URL ...] --model PATH``: loads the checkpoint at PATH as the
trainer does (``fa3_sink`` attention, sequential experts, float32 by default), runs
``trl_gptoss.rollout.weights.check_sync.check_sync`` against every server, prints a table (``--json``: the report as
JSON) and exits 0 when every group reached every server, 1 when a row failed, 2 when the check could not run.
Every argument is checked before any server is called (a checkpoint directory, finite numbers, a visible GPU for
``--device cuda``, a ``--moved-tolerance`` that cannot pass a server which kept its old weights); the servers'
secret comes from ``--secret-file`` or the environment (``trl_gptoss.rollout.server_secret``).
"""

from __future__ import annotations

import argparse
import json
import sys

from trl_gptoss.scripts.vllm_serve import at_least, checkpoint_dir, finite_positive


def _moved_tolerance(text: str) -> float:
    from trl_gptoss.rollout.weights.check_sync import MAX_MOVED_TOLERANCE

    value = finite_positive(text)
    if value >= MAX_MOVED_TOLERANCE:
        raise argparse.ArgumentTypeError(
            f"must be < {MAX_MOVED_TOLERANCE:g} (1 - the stale threshold), got {text}: a server that kept its old "
            "weights could pass"
        )
    return value


def _groups(text: str) -> list[str]:
    from trl_gptoss.rollout.weights.check_sync import GROUPS

    groups = [g.strip() for g in text.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        raise argparse.ArgumentTypeError(f"unknown group {unknown[:1] or text!r}; choose from {','.join(GROUPS)}")
    return groups


def _load_model(args):
    import torch
    from transformers import AutoModelForCausalLM

    from trl_gptoss import FA3_SINK, SEQUENTIAL_EXPERTS

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        dtype=getattr(torch, args.dtype),
        attn_implementation=FA3_SINK,
        experts_implementation=SEQUENTIAL_EXPERTS,
        device_map={"": device},
    )
    return model.eval()


def _tokenizer(path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def _special_added_ids(tokenizer) -> list[int]:
    """Harmony's control tokens (``<|start|>``, ``<|call|>``, ...) are added tokens marked special."""
    return [i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special]


def _prompts(args, model) -> list[list[int]]:
    """``--prompt`` texts tokenised with the checkpoint's tokenizer, else random ordinary token ids."""
    from trl_gptoss.rollout.weights.check_sync import random_prompts

    tokenizer = _tokenizer(args.model)
    if args.prompt:
        if tokenizer is None:
            raise ValueError(f"--prompt needs a tokenizer in {args.model}; drop --prompt to score random token ids")
        return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in args.prompt]
    vocab = model.config.vocab_size if tokenizer is None else min(model.config.vocab_size, len(tokenizer))
    exclude = () if tokenizer is None else {*tokenizer.all_special_ids, *_special_added_ids(tokenizer)}
    return random_prompts(vocab, args.num_prompts, args.prompt_len, seed=args.seed, exclude=exclude)


def _fresh_scores(args, prompts):
    """``--fresh start``: the log-probs of a server started here from the checkpoint (stopped afterwards)."""
    from trl_gptoss.rollout.server import VLLMServer
    from trl_gptoss.rollout.server_secret import new_secret
    from trl_gptoss.rollout.vllm_engine import VLLMServerEngine
    from trl_gptoss.rollout.weights.check_sync import server_logprobs

    length = max(len(p) for p in prompts) + 16
    secret = new_secret()
    with VLLMServer(
        args.model, max_model_len=length, max_num_seqs=4, device=args.fresh_device, secret=secret
    ) as server:
        engine = VLLMServerEngine(server.base_url, timeout=args.timeout, secret=secret)
        try:
            return server_logprobs(engine, prompts)
        finally:
            engine.close()


def _missing_devices(args) -> str | None:
    """A message when ``--device`` or ``--fresh-device`` names a GPU this machine does not have."""
    wanted = [
        f"--{name.replace('_', '-')} cuda" for name in ("device", "fresh_device") if getattr(args, name) == "cuda"
    ]
    if wanted:
        import torch

        if not torch.cuda.is_available():
            return f"{' and '.join(wanted)}, but no CUDA device is visible here; use cpu or run on a GPU host"
    return None


def _vocab_size(model_dir: str) -> int | None:
    from pathlib import Path

    try:
        value = json.loads((Path(model_dir) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _cmd_check_sync(args) -> int:
    from trl_gptoss.rollout.multi_server import server_urls
    from trl_gptoss.rollout.vllm_engine import VLLMServerEngine
    from trl_gptoss.rollout.weights.check_sync import check_sync, format_report
    from trl_gptoss.scripts.vllm_serve import secret_of

    if problem := _missing_devices(args):
        print(f"trl-gptoss check-sync: {problem}", file=sys.stderr)
        return 2
    engines = []
    try:
        options = {"timeout": args.timeout, "secret": secret_of(args), "vocab_size": _vocab_size(args.model)}
        for url in server_urls(args.server, name="--server"):  # every server answers before the model is loaded
            engines.append(VLLMServerEngine(url, args.served_model, **options))
        model = _load_model(args)
        prompts = _prompts(args, model)
        fresh = {"none": None, "found": "as_found"}.get(args.fresh)
        if args.fresh == "start":
            fresh = _fresh_scores(args, prompts)
        report = check_sync(
            engines,
            model,
            prompts,
            groups=args.groups,
            scale=args.scale,
            seed=args.seed,
            tolerance=args.tolerance,
            moved_tolerance=args.moved_tolerance,
            fresh=fresh,
        )
    except (RuntimeError, ValueError, OSError) as exc:  # a dead server, a refused or failed push
        print(f"trl-gptoss check-sync: {exc}", file=sys.stderr)
        return 2
    finally:
        for engine in engines:
            engine.close()
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1


def register(sub) -> None:
    """Add ``check-sync`` to the console script's subparsers."""
    from trl_gptoss.rollout.weights.check_sync import GROUPS

    check = sub.add_parser(
        "check-sync",
        help="push a checkpoint to running vLLM servers and prove every parameter group arrived",
        description=(
            "Perturbs one parameter group at a time, pushes, and compares each server's prompt log-probs with "
            "the trainer's recomputation; the servers are left serving the checkpoint. Exit 0: all passed, "
            "1: a check failed, 2: the check could not run. See docs/rollouts.md#check-sync."
        ),
    )
    check.add_argument("--server", action="append", required=True, help="server base URL; repeat for several")
    check.add_argument("--model", required=True, type=checkpoint_dir, help="the checkpoint directory the servers serve")
    check.add_argument(
        "--secret-file",
        default=None,
        help="file (mode 600) with the servers' secret (default: $TRL_GPTOSS_SERVER_SECRET or the file named by "
        "$TRL_GPTOSS_SERVER_SECRET_FILE)",
    )
    check.add_argument(
        "--tolerance",
        type=finite_positive,
        default=1e-4,
        help="max |logp_server - logp_trainer| that passes (1e-4 for float32 servers; bf16: see the docs)",
    )
    check.add_argument(
        "--moved-tolerance",
        type=_moved_tolerance,
        default=None,
        help="bf16 servers: a group also passes when the server reproduces 1 +- this of the perturbation's effect "
        "(e.g. 0.2; below 0.9, so that a server which kept its old weights never passes); see the docs",
    )
    check.add_argument("--scale", type=finite_positive, default=0.2, help="perturbation size, times each tensor's RMS")
    check.add_argument("--seed", type=int, default=0, help="seed of the perturbations and random prompts")
    check.add_argument("--groups", type=_groups, default=list(GROUPS), help=f"comma list from {','.join(GROUPS)}")
    check.add_argument("--num-prompts", type=at_least(1), default=4, help="random token-id prompts (without --prompt)")
    check.add_argument("--prompt-len", type=at_least(2), default=32, help="tokens per random prompt")
    check.add_argument("--prompt", action="append", help="score this text instead (repeatable; needs a tokenizer)")
    check.add_argument("--device", choices=("cpu", "cuda"), default=None, help="trainer side; default cuda if any")
    check.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="trainer-side dtype")
    check.add_argument(
        "--fresh",
        choices=("none", "found", "start"),
        default="none",
        help="'found': the servers were started from --model and not pushed since, so the restored servers must "
        "equal how they were found; 'start': start a fresh server here and compare with it",
    )
    check.add_argument("--fresh-device", choices=("cpu", "cuda"), default=None, help="device of --fresh start")
    check.add_argument("--served-model", default=None, help="model id on the servers (default: the only one)")
    check.add_argument(
        "--timeout", type=finite_positive, default=300.0, help="deadline of one HTTP call, whole answer included (s)"
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(func=_cmd_check_sync)
