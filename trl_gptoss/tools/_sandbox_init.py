"""PID 1 of one sandboxed call: prepares the namespaces, runs the model's code, reaps, exits.

(With ``"mode": "process"`` — the fallback isolation — it only joins the cgroups, sets the limits, drops
privileges and execs the program: a launcher that spares the host a ``preexec_fn``, which forks the whole
host process and can deadlock when the host has threads.)

This file is executed (never imported) as ``python -I -S _sandbox_init.py CONFIG_JSON`` by
``unshare --net --pid --mount --fork --kill-child --mount-proc``, i.e. as root inside fresh network, PID
and mount namespaces. The code to run arrives on stdin. Steps, all inside the private mount namespace so
the host's view never changes:

0. Join the call's memory and pids cgroups (when the host gave us some).
1. Hide ``hide_dirs`` (e.g. ``/root``, whose secrets the code must not read) under empty tmpfs mounts, but
   bind the interpreter's directories back in, so a non-root uid can start Python from a private install.
2. Make every existing mount read-only and nosuid (``mount_setattr(AT_RECURSIVE)``).
3. Mount fresh size-limited tmpfs on ``/tmp``, ``/dev/shm``, ``/var/tmp`` (binding back, read-only, the
   interpreter's directories that lived there, e.g. a virtualenv in /tmp); the working directory is
   ``/tmp/work`` (owned by the call's uid), so everything written vanishes with the mount namespace.
4. Fork: the child drops to an unprivileged uid (its own per-call uid, so ``RLIMIT_NPROC`` counts only
   this call's processes), sets resource limits and ``no_new_privs``, and execs Python on ``main.py``.
5. This process reaps orphans until the child exits, then exits with the child's status; the kernel then
   SIGKILLs every other process of the PID namespace (daemons, setsid escapes, fork bombs). It also arms
   its own ``alarm`` (wall limit + 2 s), so the call ends even if the host process dies without killing it.

Exit status: the child's exit code, or ``128 + signal`` when it was killed by a signal.
"""

import ctypes
import json
import os
import resource
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 0x1, 0x2, 0x4, 0x20, 0x1000, 0x4000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # x86_64 and aarch64 share the number of this (new-style) syscall
PR_SET_NO_NEW_PRIVS = 38
ALARM_EXIT = 124
SCRATCH_DIRS = ("/tmp", "/dev/shm", "/var/tmp")
WORKDIR = "/tmp/work"  # inside the call's own /tmp tmpfs, so it vanishes with the mount namespace

LIBC = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sandbox init: {what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    args = [s.encode() if s is not None else None for s in (source, target, fstype, data)]
    _check(LIBC.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]), f"mount {target}")


def _tmpfs(target, size, mode, uid=0, gid=0):
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={mode:o},uid={uid},gid={gid}")


def _cover_keeping(target, size, mode, keep):
    """Cover ``target`` with a fresh tmpfs, then bind each path of ``keep`` (the interpreter's directories that
    lived under it: a pyenv under /root, a virtualenv under /tmp) back at its own place, read-only. The paths
    are reached through ``O_PATH`` descriptors opened before the tmpfs covers them."""
    handles = [(os.open(path, os.O_PATH | os.O_DIRECTORY), path) for path in keep]
    _tmpfs(target, size, mode)
    for fd, path in handles:
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
        os.close(fd)


def _make_everything_read_only():
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    ret = LIBC.syscall(
        SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)
    )
    _check(ret, "mount_setattr(/, RDONLY|NOSUID, AT_RECURSIVE)")


def prepare_filesystem(cfg):
    for hide_dir, keep in cfg["hide"]:
        _cover_keeping(hide_dir, "1m", 0o755, keep)
    _make_everything_read_only()
    disk = cfg["limits"]["disk_bytes"]
    for scratch in SCRATCH_DIRS:
        if os.path.isdir(scratch):
            _cover_keeping(scratch, disk, 0o1777, [p for p in cfg["python_dirs"] if p.startswith(scratch + "/")])
    os.mkdir(WORKDIR, 0o700)
    os.chown(WORKDIR, cfg["uid"], cfg["uid"])


def _set_limits(limits, nproc):
    for res, value in (
        (resource.RLIMIT_CPU, limits["cpu_seconds"]),
        (resource.RLIMIT_AS, limits["address_space_bytes"]),
        (resource.RLIMIT_NPROC, nproc),
        (resource.RLIMIT_FSIZE, limits["file_size_bytes"]),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(res, (value, value))


def join_cgroups(procs_paths):
    """Move PID 1 into the call's memory/pids cgroups; every process it starts inherits them."""
    for path in procs_paths:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


def run_child(cfg, workdir, argv):
    """Drop privileges (when ``cfg["uid"]`` is set), apply the rlimits, exec ``argv`` (never returns)."""
    uid = cfg["uid"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
    _set_limits(cfg["limits"], cfg.get("nproc") or cfg["limits"]["max_processes"])
    if uid is not None:
        os.setresuid(uid, uid, uid)
    _check(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    os.chdir(workdir)
    os.execve(argv[0], argv, cfg["env"])


def run_process_mode(cfg):
    """Fallback isolation: no namespaces; join the cgroups, limit, drop and exec in this very process
    (same pid and process group as the host launched, so the host's kill reaches the program)."""
    join_cgroups(cfg["cgroup_procs"])
    run_child(cfg, cfg["workdir"], cfg["argv"])


def reap_until(child):
    """Reap every child (orphans are re-parented to PID 1) until ``child`` exits; return its status."""
    while True:
        pid, status = os.wait()
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code


def main():
    cfg = json.loads(sys.argv[1])
    if cfg["mode"] == "process":
        try:
            run_process_mode(cfg)
        except BaseException as exc:  # noqa: BLE001 - report any set-up failure, then die
            os.write(2, f"sandbox launcher: could not start the program: {exc!r}\n".encode())
        os._exit(125)
    code = sys.stdin.buffer.read()
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    join_cgroups(cfg["cgroup_procs"])  # before the filesystem (cgroupfs included) turns read-only
    prepare_filesystem(cfg)
    main_py = os.path.join(WORKDIR, "main.py")
    with open(main_py, "wb") as f:
        f.write(code)
    os.chown(main_py, cfg["uid"], cfg["uid"])
    # Our own wall clock: if the host process dies without killing us, the call still ends (PID 1 exits
    # on SIGALRM and the kernel kills the rest of the namespace).
    signal.signal(signal.SIGALRM, lambda *_: os._exit(ALARM_EXIT))
    signal.alarm(int(cfg["limits"]["wall_seconds"]) + 2)
    sys.stdout.flush()
    child = os.fork()
    if child == 0:
        try:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            run_child(cfg, WORKDIR, [cfg["python"], "-I", "-u", "main.py"])
        except BaseException as exc:  # noqa: BLE001 - report any set-up failure, then die
            os.write(2, f"sandbox init: could not start the program: {exc!r}\n".encode())
        os._exit(125)
    os._exit(reap_until(child))


if __name__ == "__main__":
    main()
