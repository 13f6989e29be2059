"""The shared secret that guards a rollout server's control routes (weights, pause and resume, caches).

A server the trainer starts gets a fresh secret (``new_secret``) that only that run holds. A server the user
starts (``trl-gptoss vllm-serve``) takes one from ``--secret-file FILE`` or from the environment:
``$TRL_GPTOSS_SERVER_SECRET``, or a file named by ``$TRL_GPTOSS_SERVER_SECRET_FILE``; the trainer, the weight
pushers and ``check-sync`` read the same variables (``secret_from_environment``). Clients send it as
``Authorization: Bearer <secret>`` (``auth_headers``); inside the server ``vllm_worker/gptoss_vllm_auth.py``
answers 401 to every route but the serving and read-only ones when it is missing or wrong. A server without a
secret binds loopback only (``is_loopback``).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import stat
from pathlib import Path

SECRET_ENV = "TRL_GPTOSS_SERVER_SECRET"
SECRET_FILE_ENV = "TRL_GPTOSS_SERVER_SECRET_FILE"
MIN_SECRET_CHARS = 16
MAX_SECRET_FILE_BYTES = 4096  # one secret and a newline; a larger file is not a secret file
_MAKE_ONE = "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE; chmod 600 FILE"


def new_secret() -> str:
    """A fresh secret for one run (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def check_secret(secret, source: str) -> str:
    """``secret`` when it is at least ``MIN_SECRET_CHARS`` printable ASCII characters without spaces (it travels
    in an HTTP header); else a ``ValueError`` naming ``source``."""
    if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS or not all(33 <= ord(c) < 127 for c in secret):
        raise ValueError(
            f"{source}: a server secret must be at least {MIN_SECRET_CHARS} printable ASCII characters without "
            f"spaces ({_MAKE_ONE})"
        )
    return secret


def read_secret_file(path) -> str:
    """The secret in ``path`` (surrounding whitespace stripped). Refused, with a message naming the file: not a
    regular file; not owned by this user (a file someone else planted, even mode 600, is theirs); readable by
    other users; larger than ``MAX_SECRET_FILE_BYTES``; in a directory another user controls (``_check_directory``:
    the one that holds the name and, for a symlink, the one that holds the file). Checked on the opened file."""
    path = Path(path).expanduser()
    for directory in dict.fromkeys([path.absolute().parent, Path(os.path.realpath(path)).parent]):
        _check_directory(directory, path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ValueError(f"secret file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        _check_file(info, path)
        data = file.read(MAX_SECRET_FILE_BYTES + 1)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ValueError(f"secret file {path} is larger than {MAX_SECRET_FILE_BYTES} bytes; it should hold one secret")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"secret file {path} is not ASCII text ({_MAKE_ONE})") from None
    return check_secret(text.strip(), f"secret file {path}")


def _check_file(info: os.stat_result, path: Path) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"secret file {path} is not a regular file")
    if info.st_uid != os.geteuid():
        raise ValueError(
            f"secret file {path} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}): someone else could "
            f"have put it there; write your own ({_MAKE_ONE})"
        )
    if info.st_mode & 0o077:
        mode_text = f"{stat.S_IMODE(info.st_mode):o}"
        raise ValueError(f"secret file {path} can be read by other users (mode {mode_text}); chmod 600 {path}")
    if info.st_size > MAX_SECRET_FILE_BYTES:
        raise ValueError(f"secret file {path} is larger than {MAX_SECRET_FILE_BYTES} bytes; it should hold one secret")


def _check_directory(directory: Path, path: Path) -> None:
    """A directory another user owns, or may write without the sticky bit, lets them replace the secret file (or
    the link to it) with their own: refused. ``/tmp`` (sticky, root's) is fine: others cannot rename or remove a
    file they do not own there."""
    try:
        info = directory.stat()
    except OSError as exc:
        raise ValueError(f"secret file {path}: its directory {directory}: {exc.strerror}") from None
    if info.st_uid not in (os.geteuid(), 0):
        raise ValueError(
            f"secret file {path} is in {directory}, which belongs to uid {info.st_uid}: they could replace it; "
            "keep the secret in a directory of yours (e.g. your home)"
        )
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise ValueError(
            f"secret file {path} is in {directory}, which other users can write (mode "
            f"{stat.S_IMODE(info.st_mode):o}, not sticky): they could replace it; keep the secret in a directory "
            f"only you can write (chmod go-w {directory})"
        )


def secret_from_environment(environ=None) -> str | None:
    """``$TRL_GPTOSS_SERVER_SECRET``, else the contents of ``$TRL_GPTOSS_SERVER_SECRET_FILE``, else ``None``."""
    environ = os.environ if environ is None else environ
    if environ.get(SECRET_ENV):
        return check_secret(environ[SECRET_ENV], f"${SECRET_ENV}")
    if environ.get(SECRET_FILE_ENV):
        return read_secret_file(environ[SECRET_FILE_ENV])
    return None


def auth_headers(secret: str | None) -> dict[str, str]:
    """The request headers that carry ``secret`` (none without one)."""
    return {} if secret is None else {"Authorization": f"Bearer {secret}"}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is reachable only from this machine: every address it resolves to
    is a loopback address. ``0.0.0.0`` and ``::`` (every interface) are not."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
