"""A call's writable scratch file systems (``/tmp``, ``/dev/shm``, ``/mnt/data``): tmpfs with a size and an inode cap.

bubblewrap's ``--tmpfs`` takes a size but no ``nr_inodes``, and a tmpfs's default inode count is half the
host's RAM pages: a call that creates a million empty files stays under ``size=``, and tearing that tmpfs
down (evicting every inode) outlasts the wall clock and keeps the call's cgroups busy. So, where the host
process may mount (root with ``CAP_SYS_ADMIN``), it mounts each tmpfs itself with ``size=`` and
``nr_inodes=``, private (no mount propagation), under a 0700 staging directory; bubblewrap's new mount
namespace starts with a copy of the host's mounts, from which it binds them (``--bind``), and the host
unmounts its own copies as soon as bubblewrap has created that namespace (``--info-fd``), milliseconds
after mounting them, and removes their directories after the call. Elsewhere the call gets bubblewrap's
``--tmpfs`` (size only; see ``docs/tools_and_rewards.md``).

A staging directory lives in the shared ``$TMPDIR``, where any local user can plant a name, so removing one
(``remove_staging``; ``reap_dead_staging`` for those a killed host left) never follows a link: the directory
is opened with ``O_NOFOLLOW`` and must be a directory owned by this user and closed to others (``0700``),
every mount point in it is reached through that open descriptor and unmounted with ``UMOUNT_NOFOLLOW``, and
anything else (a symlink, another user's directory) is left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import stat
import tempfile

MS_NOSUID, MS_NODEV, MS_PRIVATE = 0x2, 0x4, 0x40000
MNT_DETACH, UMOUNT_NOFOLLOW = 0x2, 0x8
STAGING_PREFIX = "trl-gptoss-scratch-"  # + host pid: a leftover of a dead process can be told and removed


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    if _libc().mount(encode(source), encode(target), encode(fstype), flags, encode(data)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount {fstype or 'private'} on {target}: {os.strerror(code)}")


def _unmount(path: str) -> None:
    # An error means it is not mounted (or is a symlink, which is never followed): nothing to undo.
    _libc().umount2(path.encode(), MNT_DETACH | UMOUNT_NOFOLLOW)


class Scratch:
    """Host-mounted tmpfs for one call: ``binds`` are the bubblewrap arguments. ``unmount()`` (once bubblewrap
    has created its namespace) drops the host's copies; ``remove()`` (after the call) the staging directory.
    The directories must outlive bubblewrap's binds: removing a mount point detaches the mounts on it in
    every mount namespace, the call's copies included."""

    def __init__(self, targets: tuple[str, ...], size_bytes: int, inodes: int):
        self.staging = tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-")
        self.binds: list[str] = []
        self._mounted: list[str] = []
        try:
            for index, target in enumerate(targets):
                path = os.path.join(self.staging, str(index))
                os.mkdir(path, 0o700)
                options = f"mode=1777,size={size_bytes},nr_inodes={inodes}"
                _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options)
                self._mounted.append(path)
                _mount(None, path, None, MS_PRIVATE, None)  # host unmounts must not reach the call's copy
                self.binds += ["--bind", path, target]
        except BaseException:
            self.remove()
            raise

    def unmount(self) -> None:
        for path in self._mounted:
            _unmount(path)
        self._mounted = []

    def remove(self) -> None:
        self.unmount()
        remove_staging(self.staging)


def _open_own_directory(path: str) -> int | None:
    """An ``O_NOFOLLOW`` descriptor of ``path`` when it is a directory of this user closed to others, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # a symlink (ELOOP), not a directory, gone
        return None
    info = os.fstat(fd)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(fd)
        return None
    return fd


def remove_staging(staging: str) -> bool:
    """Unmount and remove a staging directory of this user; ``False`` (nothing touched) for anything else."""
    fd = _open_own_directory(staging)
    if fd is None:
        return False
    try:
        for name in os.listdir(fd):
            entry = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISDIR(entry.st_mode):
                continue  # we only ever create directories here: leave anything else alone
            _unmount(f"/proc/self/fd/{fd}/{name}")  # through the open directory: no path to swap
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(staging)  # only if empty; /tmp's sticky bit keeps other users from swapping it meanwhile
    return True


@functools.lru_cache(maxsize=1)
def host_can_mount() -> bool:
    """True when this process can mount the capped tmpfs itself (probed once, with a real mount)."""
    if os.geteuid() != 0:
        return False
    try:
        Scratch(("/probe",), 1 << 20, 16).remove()
    except OSError:
        return False
    return True


def reap_dead_staging() -> int:
    """Unmount and remove staging directories of processes that died between mount and unmount."""
    removed = 0
    directory = tempfile.gettempdir()
    for name in os.listdir(directory):
        if not name.startswith(STAGING_PREFIX):
            continue
        pid = name[len(STAGING_PREFIX) :].partition("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            removed += remove_staging(os.path.join(directory, name))
    return removed
