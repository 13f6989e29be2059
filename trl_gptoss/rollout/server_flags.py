"""Which vLLM flags a caller may pass through to the rollout server, and which decide its reach and are ours.

The server's address, port, authentication middleware and worker extension are chosen by ``VLLMServer`` after
every pass-through flag is known; vLLM keeps the last of a repeated flag, so a pass-through ``--host 0.0.0.0``
would silently undo the loopback rule (a server other machines reach, with no secret). Every flag that changes who
may reach or control the server is therefore refused in the pass-through flags, naming the option of ours that
sets it (or saying that none does).

Matched the way vLLM's parser reads them (``FlexibleArgumentParser`` over argparse): ``--flag value``,
``--flag=value``, underscores for dashes, dotted sub-keys (``--kv-transfer-config.kv_ip=...``), and argparse's
unique-prefix abbreviations (``--hos 0.0.0.0`` binds like ``--host``), so a flag is refused when it is a prefix of a
guarded one. ``--config FILE`` is refused too: a YAML config can set any of them.
"""

from __future__ import annotations

_OUR_HOST = "--host (VLLMServer(host=...))"
_OUR_PORT = "--port (VLLMServer(port=...))"
_OUR_SECRET = "--secret-file (VLLMServer(secret=...)); the server's auth middleware is ours"
_OUR_API_KEY = (
    "--secret-file (VLLMServer(secret=...)) for the control routes, and $VLLM_API_KEY set to the same secret to "
    "close sampling too"
)
_NONE = None  # no option of ours: the server's reach is --host, --port and --secret-file alone

# flag -> the option of ours that decides it, or None
GUARDED_FLAGS: dict[str, str | None] = {
    "--host": _OUR_HOST,
    "--port": _OUR_PORT,
    "--uds": _OUR_HOST,
    "--api-key": _OUR_API_KEY,
    "--middleware": _OUR_SECRET,
    "--worker-extension-cls": _NONE,
    "--worker-cls": _NONE,
    "--config": "the flags themselves after `--` (a config file may set the host, port or middleware)",
    "--root-path": _NONE,
    "--grpc": _NONE,
    "--grpc-port": _NONE,
    "--allowed-origins": _NONE,
    "--allowed-methods": _NONE,
    "--allowed-headers": _NONE,
    "--allow-credentials": _NONE,
    "--ssl-keyfile": _NONE,
    "--ssl-certfile": _NONE,
    "--ssl-ca-certs": _NONE,
    "--ssl-cert-reqs": _NONE,
    "--ssl-ciphers": _NONE,
    "--enable-ssl-refresh": _NONE,
    "--data-parallel-address": _NONE,
    "--data-parallel-rpc-port": _NONE,
    "--data-parallel-supervisor-port": _NONE,
    "--master-addr": _NONE,
    "--master-port": _NONE,
    "--kv-transfer-config": _NONE,
    "--kv-events-config": _NONE,
    "--ec-transfer-config": _NONE,
}
# vLLM's short spellings of guarded flags (argparse matches these exactly, or as ``-dpa=VALUE``)
GUARDED_SHORT_FLAGS = {"-dpa": "--data-parallel-address", "-dpp": "--data-parallel-rpc-port"}


def guarded_flag(arg: str) -> str | None:
    """The guarded flag ``arg`` would set in vLLM's parser, or ``None``."""
    if arg.startswith("--") and len(arg) > 2:
        name = arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        if not name:
            return None
        matches = [flag for flag in GUARDED_FLAGS if flag[2:].startswith(name)]
        exact = "--" + name
        return exact if exact in GUARDED_FLAGS else (matches[0] if matches else None)
    if arg.startswith("-") and not arg.startswith("--"):
        return GUARDED_SHORT_FLAGS.get(arg.split("=", 1)[0])
    return None


def refuse_reach_flags(extra_args) -> None:
    """Raise ``ValueError`` naming the first pass-through flag that would change who may reach or control the
    server, and the option of ours to use instead."""
    for arg in map(str, extra_args):
        flag = guarded_flag(arg)
        if flag is None:
            continue
        ours = GUARDED_FLAGS[flag]
        instead = (
            f"use {ours} instead"
            if ours
            else "no option of ours sets it: who may reach the server is decided by --host, --port and --secret-file"
        )
        spelled = flag if arg.split("=", 1)[0] == flag else f"{arg!r} (which vLLM may read as {flag})"
        raise ValueError(
            f"the vLLM flag {spelled} is not accepted among the pass-through flags (after `--`, or "
            f"VLLMServer(extra_args=...)): it changes who may reach or control the server; {instead}"
        )
