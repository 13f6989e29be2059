"""The pre-forked interpreter of one ``PythonSandbox``: started once inside bubblewrap, it forks every call.

Executed as ``python -I -u /.sandbox/zygote.py <CallConfig argv> -- KEY=VALUE ...`` next to a copy of
``init.py`` (whose steps it reuses), never imported by the host. Standard library only; it imports the
``preload`` packages (numpy) once and freezes its objects out of the garbage collector, so a call that
imports them finds them in ``sys.modules`` and a call's collections never touch (and copy) the zygote's
pages. It never runs model-written code itself, and never reads a call's code (a memfd only the call's
program reads): every call is a fresh fork, so nothing a call does reaches the next one.

The zygote runs as root of the sandbox's user namespace with ``CAP_SYS_ADMIN``, ``CAP_NET_ADMIN``,
``CAP_SETUID`` and ``CAP_SETGID`` there (none on the host), without the seccomp filter. Between requests it
keeps one call prepared (a *spare*):

1. its PID 1 is forked into a new PID namespace (``unshare(CLONE_NEWPID)``, ``fork``, then ``setns`` back, so
   the next one can do the same); it enters new mount, IPC and network namespaces, mounts a fresh ``/proc``
   (``/proc/sys`` & co. read-only, as bubblewrap does), a new ``devpts`` instance and size- and inode-capped
   tmpfs on the scratch targets (the view's paths beneath one, a virtualenv under ``/tmp``, rebuilt on it),
   brings its loopback up and forks the program (PID 2), which waits for its request.

The host's request (control socket, ``SOCK_SEQPACKET``) is ``{"uid": N}`` with, by ``SCM_RIGHTS``, the call's
socket, its stdout and stderr pipes, a memfd with the code and the opened ``cgroup.procs`` of its cgroups. The
zygote hands the call's socket to the spare's PID 1 and the rest to its program, then prepares the next spare
when idle. Then:

2. the program joins the call's cgroups (writing ``0`` to each ``cgroup.procs``), writes ``main.py``, sets the
   rlimits, drops to the call's uid, closes every descriptor above stderr, installs the seccomp filter
   (``no_new_privs`` is set) and runs ``main.py`` as ``__main__`` (``init.run_main``);
3. PID 1 reaps until the program exits; if nothing else of the call is left (its ``/proc`` lists only PID 1)
   it sends ``x<exit code>`` (128 + N for a signal N, as bubblewrap's PID 1) on the call's socket at once,
   and exits; its exit kills whatever else is left.

The zygote watches each call's PID 1 through a pidfd and the call's socket: on ``k`` or end-of-file from the
host it SIGKILLs that PID 1 (its own unreaped child, so never a reused pid); once it has reaped it (the whole
PID namespace is gone by then) it sends ``x<exit code>`` too (the host keeps the first). End-of-file on the
control socket ends the zygote, and with it (bubblewrap's PID 1 exits) every call still running.
"""

import contextlib
import ctypes
import gc
import importlib.util
import json
import os
import resource
import select
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
        self.kept = {}  # scratch target -> the view's entries beneath it (``preforked.kept_under_scratch``)
        if options.get("kept_fd", -1) >= 0:
            with os.fdopen(options["kept_fd"], "rb") as f:
                self.kept = json.loads(f.read())
        self.pid = os.getpid()
        self.pid_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY)
        self.selector = selectors.DefaultSelector()
        self.calls = {}  # pid of a running call's PID 1 -> [its socket (None once the host closed it), pidfd]
        self.sockets = {}  # call socket -> pid of its PID 1, until the host closes it
        self.spare = None  # the next call, ready but for its request
        self.spare_failed = False

    def serve(self):
        self.selector.register(self.control, selectors.EVENT_READ, ("control", None))
        self.control.send(b"ready")
        while True:
            events = self.selector.select(timeout=0 if self.spare is None and not self.spare_failed else None)
            if not events:  # nothing to do: get the next call's namespaces ready
                self.spare = self.prepare()
                continue
            for key, _ in events:
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
            spare = self.dispatch(message, call, fds[1:])
        except Exception as exc:  # noqa: BLE001 - tell the call, keep serving the others
            os.write(fds[2], f"sandbox zygote: could not start the program: {exc!r}\n".encode())
            with contextlib.suppress(OSError):
                call.send(b"x125")
            pid = None  # nothing runs; the socket stays open until the host closes it
        else:
            pid = spare.pid
            self.calls[pid] = [call, spare.pidfd]
            self.selector.register(spare.pidfd, selectors.EVENT_READ, ("exited", pid))
        finally:
            for fd in fds[1:]:  # the program has its copies
                os.close(fd)
        self.sockets[call] = pid
        self.selector.register(call, selectors.EVENT_READ, ("host", pid))

    def dispatch(self, message, call, fds):
        """Hand the request to the spare call (a fresh one if there is none or it died): ``fds`` to its program,
        the call's socket to its PID 1. Returns that spare."""
        self.spare_failed = False
        for attempt in range(2):
            spare, self.spare = self.spare, None
            if spare is None or select.select([spare.pidfd], [], [], 0)[0]:
                if spare is not None:
                    spare.discard()
                spare = self.prepare()
                if spare is None:
                    raise OSError("could not prepare the call's namespaces (see the zygote's stderr)")
            try:
                socket.send_fds(spare.program, [message], fds)
                socket.send_fds(spare.pid1, [b"c"], [call.fileno()])
            except OSError:
                spare.discard()
                if attempt:
                    raise
                continue
            spare.pid1.close()  # each reads its message before it sees end-of-file
            spare.program.close()
            return spare
        raise AssertionError("unreachable")

    def prepare(self):
        """A spare call: its PID 1 forked into a new PID namespace (``unshare(CLONE_NEWPID)``, ``fork``, ``setns``
        back, so the next one can do the same) sets up the other namespaces and forks the program, which waits
        for its request. ``None`` (and no retry until the next request) when that fails."""
        pid1_ours, pid1_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        program_ours, program_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            check(libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")  # for the next child only
            try:
                pid = os.fork()
            finally:
                if os.getpid() == self.pid:  # the zygote; the child stays in the new namespace, as its PID 1
                    self.restore_pid_namespace()
        except OSError as exc:
            os.write(2, f"sandbox zygote: could not prepare a call: {exc!r}\n".encode())
            for end in (pid1_ours, pid1_theirs, program_ours, program_theirs):
                end.close()
            self.spare_failed = True
            return None
        if pid == 0:
            self.call_main(pid1_theirs, program_theirs)  # never returns
        pid1_theirs.close()
        program_theirs.close()
        return Spare(pid, os.pidfd_open(pid), pid1_ours, program_ours)

    def restore_pid_namespace(self):
        """Children go to the zygote's own PID namespace again, so the next ``unshare`` can make a new one."""
        if libc.setns(self.pid_namespace, CLONE_NEWPID) != 0:
            os.write(2, f"sandbox zygote: setns: {os.strerror(ctypes.get_errno())}\n".encode())
            os._exit(1)  # the host starts a new zygote

    def from_host(self, call):
        """``k`` or end-of-file from the host: SIGKILL the call's PID 1 while it is our unreaped child. The
        socket is closed only at the host's end-of-file (closing it with an unread ``k`` would reset it, and
        the host would lose the exit status)."""
        if call not in self.sockets:  # closed by ``reap`` while handling the same batch of events
            return
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
        """The call's PID 1 ended, so did every process of its namespace: report its exit code (again, if PID 1
        did already: the host reads the first)."""
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

    def call_main(self, zygote, for_program):
        """The call's PID 1 (this fork): namespaces and mounts, the program's fork, then (once the zygote sent
        the call's socket and the program its request) reaping; never returns. When the program has ended as the
        namespace's last process (``/proc`` lists nobody else), it sends the exit code to the host itself
        before it exits: the call is over without waiting for the namespaces' tear-down. Otherwise its exit
        kills the rest, and the zygote reports once it has reaped it."""
        try:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            keep = {0, 1, 2, zygote.fileno(), for_program.fileno()}
            for fd in os.listdir("/proc/self/fd"):  # the zygote's: control socket, other calls' sockets, ...
                if int(fd) not in keep:
                    with contextlib.suppress(OSError):  # the listing's own descriptor is already closed
                        os.close(int(fd))
            self.enter_namespaces()
            program = os.fork()
        except BaseException as exc:  # noqa: BLE001 - report any set-up failure, never run the code
            os.write(2, f"sandbox zygote: could not prepare a call: {exc!r}\n".encode())
            os._exit(125)
        if program == 0:
            zygote.close()
            self.program_main(for_program)
        for_program.close()
        devnull = os.open("/dev/null", os.O_RDWR)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
        _, fds, _, _ = socket.recv_fds(zygote, 16, 1)  # the call's socket; nothing if the zygote went away
        zygote.close()
        call = socket.socket(fileno=fds[0]) if fds else None
        while True:  # PID 1: reap orphans until the program ends, then end the namespace with its status
            pid, status = os.wait()
            if pid == program:
                code = status >> 8 if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
                if call is not None and not any(p.isdigit() and p != "1" for p in os.listdir("/proc")):
                    with contextlib.suppress(OSError):
                        call.send(b"x%d" % code)
                os._exit(code)

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
        for target in self.options["scratch"]:
            self.mount_scratch(target, self.kept.get(target, ()))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            import fcntl

            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", IFF_UP_LOOPBACK_RUNNING))

    def mount_scratch(self, target, kept):
        """The call's own tmpfs on ``target``. ``kept``: the view's paths beneath it (a virtualenv under ``/tmp``),
        rebuilt on the fresh tmpfs in the view's order from the zygote's own ``target``, still reachable through a
        descriptor opened before the mount: directories (root's, 0755: the call cannot rename or remove them, even
        in a sticky ``/tmp``), symlinks, and each mount re-bound with its submounts (and its read-only flag)."""
        size, files = self.options["disk_bytes"], self.options["disk_files"]
        below = os.open(target, os.O_PATH | os.O_DIRECTORY) if kept else -1
        try:
            mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={size},nr_inodes={files}")
            for kind, *operands in kept:
                dest = operands[-1]
                hidden = f"/proc/self/fd/{below}{dest[len(target) :]}"
                make_dirs(os.path.dirname(dest))
                if kind == "dir" or (kind == "mount" and os.path.isdir(hidden)):
                    make_dirs(dest)
                elif kind == "symlink":
                    os.symlink(operands[0], dest)
                else:
                    os.close(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444))
                if kind == "mount":
                    mount(hidden, dest, None, MS_BIND | MS_REC)
        finally:
            if below >= 0:
                os.close(below)

    def program_main(self, zygote):
        """The program (PID 2): waits for its request, then joins the call's cgroups,
        writes ``main.py``, sets the limits, drops to the call's uid, closes every other descriptor, installs
        seccomp and runs ``main.py``; it never returns."""
        message, fds, _, _ = socket.recv_fds(zygote, 4096, MAX_FDS)
        if not message:  # the zygote went away before it needed this spare
            os._exit(0)
        zygote.close()
        out, err, code, *cgroup_procs = fds
        try:
            os.dup2(out, 1)
            os.dup2(err, 2)
            for fd in cgroup_procs:  # first: every later allocation and process is the call's
                os.write(fd, b"0")
            write_program(code, self.options["workdir"])
            init.set_limits(self.cfg)
            init.drop_privileges(json.loads(message)["uid"])
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


class Spare:
    """A prepared call: its PID 1 (``pid``, ``pidfd``) and the sockets on which PID 1 waits for the call's
    socket (``pid1``) and the program for its request (``program``)."""

    def __init__(self, pid, pidfd, pid1_socket, program_socket):
        self.pid, self.pidfd, self.pid1, self.program = pid, pidfd, pid1_socket, program_socket

    def discard(self):
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os.close(self.pidfd)
        self.pid1.close()
        self.program.close()


def flush_and_exit(code):
    """End like an interpreter that ran ``main.py`` (``Py_FinalizeEx``): join non-daemon threads (only if
    ``threading`` was imported), run ``atexit``, flush, then exit without tearing the zygote's objects down."""
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing more to show
            stream.flush()
    os._exit(code & 0xFF)


def make_dirs(path):
    """``mkdir -p`` with mode 0755 whatever the umask."""
    if os.path.isdir(path):
        return
    make_dirs(os.path.dirname(path))
    os.mkdir(path)
    os.chmod(path, 0o755)


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
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # two descriptors per running call
    for name in options["preload"]:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    gc.collect()
    gc.freeze()  # a call's collections never walk (and so never copy the pages of) the zygote's objects
    Zygote(cfg, options).serve()


if __name__ == "__main__":
    main()
