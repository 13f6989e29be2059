"""The pre-forked interpreter of one ``PythonSandbox``: started once inside bubblewrap, it forks every call.

Executed as ``python -I -u /.sandbox/zygote.py <CallConfig argv> -- KEY=VALUE ...`` next to a copy of
``init.py`` (whose steps it reuses), never imported by the host. Standard library only; it imports the
``preload`` packages (numpy) once, so a call that imports them finds them in ``sys.modules``. It never runs
model-written code itself: every call is a fresh fork, so nothing a call does reaches the next one.

The zygote runs as root of the sandbox's user namespace with ``CAP_SYS_ADMIN``, ``CAP_NET_ADMIN``,
``CAP_SETUID`` and ``CAP_SETGID`` there (none on the host), without the seccomp filter. It reads requests
from the host's control socket (``SOCK_SEQPACKET``): ``{"uid": N}`` and, by ``SCM_RIGHTS``, the call's
socket, its stdout and stderr pipes, a memfd with the code and the opened ``cgroup.procs`` of its cgroups.
Per call:

1. the zygote forks the call's PID 1 into a new PID namespace (``unshare(CLONE_NEWPID)``, ``fork``, then
   ``setns`` back to its own, so the next call can do the same);
2. PID 1 enters new mount, IPC and network namespaces, mounts a fresh ``/proc`` (``/proc/sys`` & co. read-only,
   as bubblewrap does), a new ``devpts`` instance and size- and inode-capped tmpfs on the scratch targets, brings
   its loopback up, joins the call's cgroups (writing ``0`` to each ``cgroup.procs``), writes ``main.py`` and
   forks the program (PID 2), then reaps until the program exits and exits with its status (128 + N for a
   signal N, as bubblewrap's PID 1 does); its exit kills every other process of the namespace;
3. the program sets the rlimits, drops to the call's uid, closes every descriptor above stderr, installs the
   seccomp filter (``no_new_privs`` is set) and runs ``main.py`` as ``__main__`` (``init.run_main``).

The zygote watches each call's PID 1 through a pidfd and the call's socket: on ``k`` or end-of-file from the
host it SIGKILLs that PID 1 (its own unreaped child, so never a reused pid); once it has reaped it (the whole
PID namespace is gone by then) it sends ``x<exit code>`` and closes the socket. End-of-file on the control
socket ends the zygote, and with it (bubblewrap's PID 1 exits) every call still running.
"""

import contextlib
import ctypes
import gc
import importlib.util
import json
import os
import selectors
import signal
import socket
import struct
import sys

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x08000000, 0x40000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 0x1, 0x2, 0x4, 0x8, 0x20
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
SIOCSIFFLAGS, IFF_UP_LOOPBACK_RUNNING = 0x8914, 0x1 | 0x8 | 0x40
PROC_COVERED = ("sys", "sysrq-trigger", "irq", "bus")  # read-only, as bubblewrap's --proc leaves them
MAX_FDS = 16

_spec = importlib.util.spec_from_file_location("sandbox_init", os.path.join(os.path.dirname(__file__), "init.py"))
init = importlib.util.module_from_spec(_spec)
sys.dont_write_bytecode = True  # no __pycache__ next to init.py (-I ignores PYTHONDONTWRITEBYTECODE)
_spec.loader.exec_module(init)
sys.dont_write_bytecode = False  # as in a fresh `python -I`
libc = ctypes.CDLL(None, use_errno=True)


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def check(ret, what):
    if ret != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def mount(source, target, fstype, flags, data=None):
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    check(libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


def parse(argv):
    """``(CallConfig, zygote options)`` from ``<CallConfig argv> -- key=value ...`` (``scratch``/``preload`` repeat)."""
    split = argv.index("--")
    options = {"scratch": [], "preload": []}
    for arg in argv[split + 1 :]:
        key, _, value = arg.partition("=")
        if key in ("scratch", "preload"):
            options[key].append(value)
        else:
            options[key] = value if key == "workdir" else int(value)
    return init.CallConfig.from_argv(argv[:split]), options


class Zygote:
    def __init__(self, cfg, options):
        self.cfg, self.options = cfg, options
        self.control = socket.socket(fileno=options["control_fd"])
        self.filter = None
        if options["seccomp_fd"] >= 0:
            with os.fdopen(options["seccomp_fd"], "rb") as f:
                self.filter = ctypes.create_string_buffer(f.read())
            self.fprog = SockFprog(len(self.filter.raw) // 8, ctypes.addressof(self.filter))
        self.pid = os.getpid()
        self.pid_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY)
        self.selector = selectors.DefaultSelector()
        self.calls = {}  # pid of a running call's PID 1 -> [its socket (None once the host closed it), pidfd]
        self.sockets = {}  # call socket -> pid of its PID 1, until the host closes it

    def serve(self):
        self.selector.register(self.control, selectors.EVENT_READ, ("control", None))
        self.control.send(b"ready")
        while True:
            for key, _ in self.selector.select():
                kind, pid = key.data
                if kind == "control":
                    self.accept()
                elif kind == "exited":
                    self.reap(pid)
                else:
                    self.from_host(key.fileobj)

    def accept(self):
        message, fds, _, _ = socket.recv_fds(self.control, 4096, MAX_FDS)
        if not message:  # the host is gone: so are we, and bubblewrap's PID 1 takes every call with it
            os._exit(0)
        call = socket.socket(fileno=fds[0])
        try:
            pid = self.fork_call(json.loads(message), fds)
        except Exception as exc:  # noqa: BLE001 - tell the call, keep serving the others
            os.write(fds[2], f"sandbox zygote: could not start the program: {exc!r}\n".encode())
            with contextlib.suppress(OSError):
                call.send(b"x125")
            pid = None  # nothing runs; the socket stays open until the host closes it
        else:
            pidfd = os.pidfd_open(pid)
            self.calls[pid] = [call, pidfd]
            self.selector.register(pidfd, selectors.EVENT_READ, ("exited", pid))
        finally:
            for fd in fds[1:]:  # the call's PID 1 has its copies
                os.close(fd)
        self.sockets[call] = pid
        self.selector.register(call, selectors.EVENT_READ, ("host", pid))

    def fork_call(self, request, fds):
        check(libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")  # for the next child only
        try:
            pid = os.fork()
        finally:
            if os.getpid() == self.pid:  # the zygote; the child stays in the new namespace, as its PID 1
                self.restore_pid_namespace()
        if pid == 0:
            self.call_main(request, fds)  # never returns
        return pid

    def restore_pid_namespace(self):
        """Children go to the zygote's own PID namespace again, so the next ``unshare`` can make a new one."""
        if libc.setns(self.pid_namespace, CLONE_NEWPID) != 0:
            os.write(2, f"sandbox zygote: setns: {os.strerror(ctypes.get_errno())}\n".encode())
            os._exit(1)  # the host starts a new zygote

    def from_host(self, call):
        """``k`` or end-of-file from the host: SIGKILL the call's PID 1 while it is our unreaped child. The
        socket is closed only at the host's end-of-file (closing it with an unread ``k`` would reset it, and
        the host would lose the exit status)."""
        pid = self.sockets[call]
        try:
            message = call.recv(16)
        except OSError:
            message = b""
        if pid in self.calls:
            os.kill(pid, signal.SIGKILL)
        if not message:
            self.selector.unregister(call)
            del self.sockets[call]
            if pid in self.calls:
                self.calls[pid][0] = None  # nobody to report to
            else:
                call.close()

    def reap(self, pid):
        """The call's PID 1 ended, so did every process of its namespace: report its exit code to the host."""
        call, pidfd = self.calls.pop(pid)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        if call is None:
            return
        try:
            call.send(b"x%d" % os.waitstatus_to_exitcode(status))
        except OSError:  # the host is gone: close now
            self.selector.unregister(call)
            del self.sockets[call]
            call.close()

    def call_main(self, request, fds):
        """The call's PID 1 (this fork); it never returns."""
        _, out, err, code, *cgroup_procs = fds
        try:
            os.dup2(out, 1)
            os.dup2(err, 2)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            for fd in cgroup_procs:  # first: every later allocation and process is the call's
                os.write(fd, b"0")
            self.enter_namespaces()
            write_program(code, self.options["workdir"])
            keep = {0, 1, 2}
            for fd in os.listdir("/proc/self/fd"):
                if int(fd) not in keep:
                    try:  # noqa: SIM105 - the listing's own descriptor is already closed
                        os.close(int(fd))
                    except OSError:
                        pass
            program = os.fork()
        except BaseException as exc:  # noqa: BLE001 - report any set-up failure, never run the code
            os.write(2, f"sandbox zygote: could not start the program: {exc!r}\n".encode())
            os._exit(125)
        if program == 0:
            self.program_main(request["uid"])
        devnull = os.open("/dev/null", os.O_RDWR)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
        while True:  # PID 1: reap orphans until the program ends, then end the namespace with its status
            pid, status = os.wait()
            if pid == program:
                os._exit(status >> 8 if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))

    def enter_namespaces(self):
        check(libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET), "unshare")
        mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing of the call's mounts propagates back
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        for name in PROC_COVERED:
            path = f"/proc/{name}"
            if os.path.exists(path):
                mount(path, path, None, MS_BIND | MS_REC)
                mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
        size, files = self.options["disk_bytes"], self.options["disk_files"]
        for target in self.options["scratch"]:
            mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={size},nr_inodes={files}")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            import fcntl

            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", IFF_UP_LOOPBACK_RUNNING))

    def program_main(self, uid):
        """The program (PID 2): limits, uid, descriptors, seccomp, then ``main.py``; it never returns."""
        try:
            cfg = self.cfg
            init.set_limits(cfg)
            init.drop_privileges(uid)
            init.close_inherited_fds()
            check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
            if self.filter is not None:
                check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(self.fprog), 0, 0), "seccomp")
            reseed()
        except BaseException as exc:  # noqa: BLE001 - report any set-up failure, never run the code
            os.write(2, f"sandbox init: could not start the program: {exc!r}\n".encode())
            os._exit(125)
        try:
            init.run_main()
        except SystemExit as exc:
            code = exc.code
            if code is None or isinstance(code, int):
                flush_and_exit(code or 0)
            print(code, file=sys.stderr)
            flush_and_exit(1)
        flush_and_exit(0)


def flush_and_exit(code):
    """End like an interpreter that ran ``main.py``: flush, run ``atexit`` and thread joins, then exit."""
    import threading

    threading._shutdown()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing more to show
            stream.flush()
    os._exit(code & 0xFF)


def write_program(code_fd, workdir):
    os.mkdir(workdir)
    os.chmod(workdir, 0o777)
    fd = os.open(os.path.join(workdir, init.MAIN), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
    try:
        while chunk := os.read(code_fd, 1 << 20):
            os.write(fd, chunk)
    finally:
        os.close(fd)
    os.chdir(workdir)


def reseed():
    """Give each call fresh random state: ``random`` reseeds itself after ``fork``; numpy's global one does not."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def main():
    cfg, options = parse(sys.argv[1:])
    for name in options["preload"]:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    gc.collect()
    gc.freeze()  # a call's collections never walk (and so never copy the pages of) the zygote's objects
    Zygote(cfg, options).serve()


if __name__ == "__main__":
    main()
