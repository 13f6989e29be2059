"""The trusted first steps of one sandboxed call, run in the interpreter that then runs the model's code.

Executed as ``python -I -u init.py KEY=VALUE ...`` under a bubblewrap per call; the host imports it only for
``CallConfig``, so host and init share one typed config, and a zygote (``zygote.py``) loads it as a module
and runs steps 2-4 and 6 in each call's program. Standard library only, and only cheap modules: under a
bubblewrap per call this runs on every call.

Steps, before any model-written byte is compiled:

0. (bubblewrap only) wait for the host's release: the host writes ``go`` to bubblewrap's ``--block-fd`` pipe
   once it has moved the call into its cgroups; bubblewrap reads the ``g``, this reads the ``o`` from its own
   copy of the pipe. bubblewrap goes on when the pipe closes, so a host killed before its release (before
   bubblewrap armed ``--die-with-parent``, too) would leave the call running outside every cgroup, for good:
   on end-of-file this exits at once instead, and bubblewrap's PID 1 ends with it;
1. (process isolation only) join the call's cgroups, writing ``0`` ("myself") to each ``cgroup.procs`` the
   host listed; under bubblewrap the host has already moved the call into them (``bwrap.py``);
2. set the rlimits (children inherit them; without ``CAP_SYS_RESOURCE`` in the host's user namespace no
   process of the call can raise a hard limit again);
3. drop to the unprivileged uid (``setgroups([])``, ``setresgid``, ``setresuid``: the capabilities bubblewrap
   left us for this step vanish with the uid change);
4. close every inherited descriptor but stdin/stdout/stderr (bubblewrap does not close the user namespace
   fd it was given with ``--userns``);
5. (process isolation only) replace the ``socket`` constructors: a Python-level speed bump, not a wall;
6. run ``main.py`` as ``__main__`` in this interpreter (a second interpreter would cost another ~20 ms);
   a traceback shows the model's frames only.
"""

import os
import resource
import sys

MAIN = "main.py"


class CallConfig:
    """Everything the host tells the init about one call. Field types are checked when decoding.

    ``uid``: drop to this uid (-1: keep the current one, e.g. when the host is not root);
    ``cgroup_procs``: ``cgroup.procs`` files to join (may be empty); ``nproc``: ``RLIMIT_NPROC``;
    ``block_sockets``: install the Python-level socket block (process isolation only); ``release_fd``: the
    descriptor the host's release arrives on (-1: none, process isolation).
    """

    cpu_seconds: int
    address_space_bytes: int
    file_size_bytes: int
    open_files: int
    nproc: int
    uid: int
    block_sockets: bool
    release_fd: int
    cgroup_procs: tuple

    def __init__(self, **fields):
        missing = set(self.__annotations__) - set(fields)
        unknown = set(fields) - set(self.__annotations__)
        if missing or unknown:
            raise ValueError(f"CallConfig: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
        for name, kind in self.__annotations__.items():
            value = fields[name]
            if kind is int and (type(value) is not int):
                raise ValueError(f"CallConfig.{name} must be an int, got {value!r}")
            if kind is bool and type(value) is not bool:
                raise ValueError(f"CallConfig.{name} must be a bool, got {value!r}")
            if kind is tuple:
                value = tuple(value)
                if not all(isinstance(v, str) and "\0" not in v for v in value):
                    raise ValueError(f"CallConfig.{name} must hold str paths, got {value!r}")
            setattr(self, name, value)

    def to_argv(self) -> list:
        """``["key=value", ...]``; a tuple field repeats its key once per item (in order)."""
        argv = []
        for name, kind in self.__annotations__.items():
            value = getattr(self, name)
            items = value if kind is tuple else (int(value),)
            argv += [f"{name}={item}" for item in items]
        return argv

    @classmethod
    def from_argv(cls, argv):
        kinds = cls.__annotations__
        fields = {name: [] for name, kind in kinds.items() if kind is tuple}
        for arg in argv:
            name, sep, text = arg.partition("=")
            if not sep or name not in kinds:
                raise ValueError(f"CallConfig: bad argument {arg!r}")
            if kinds[name] is tuple:
                fields[name].append(text)
            else:
                fields[name] = int(text) if kinds[name] is int else bool(int(text))
        return cls(**fields)


def wait_for_release(fd):
    if fd < 0:
        return
    if os.read(fd, 1) != b"o":  # end-of-file: the host died before it released the call
        os._exit(125)


def join_cgroups(paths):
    for path in paths:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


def set_limits(cfg):
    for res, value in (
        (resource.RLIMIT_CPU, cfg.cpu_seconds),
        (resource.RLIMIT_AS, cfg.address_space_bytes),
        (resource.RLIMIT_NPROC, cfg.nproc),
        (resource.RLIMIT_FSIZE, cfg.file_size_bytes),
        (resource.RLIMIT_NOFILE, cfg.open_files),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(res, (value, value))


def drop_privileges(uid):
    if uid < 0:
        return
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid):
        raise OSError(f"could not switch to uid {uid}")


def close_inherited_fds():
    """Close every descriptor above 2 (listed from ``/proc/self/fd``; a limit-based range could miss fds
    above ``RLIMIT_NOFILE``, and ``/proc`` may be absent under process isolation: then try a range)."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        fds = range(3, 1024)
    for fd in fds:
        if fd > 2:
            try:  # noqa: SIM105 - contextlib is one more import on every call
                os.close(fd)
            except OSError:  # the listing's own descriptor, already closed
                pass


def block_sockets():
    import socket

    def no_network(*args, **kwargs):
        raise PermissionError("network access is disabled in this sandbox")

    socket.socket = socket.create_connection = socket.socketpair = socket.fromfd = no_network


def run_main():
    """Compile and run ``main.py`` as a fresh ``__main__`` module; exit like ``python main.py`` would."""
    with open(MAIN, "rb") as f:
        source = f.read()
    module = type(sys)("__main__")
    module.__file__ = MAIN
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    sys.argv = [MAIN]
    try:
        exec(compile(source, MAIN, "exec"), module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        import traceback

        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # hide the init's own frames: the model sees its code only
        traceback.print_exception(type(exc), exc, tb)
        sys.exit(1)


def main():
    try:
        cfg = CallConfig.from_argv(sys.argv[1:])
        wait_for_release(cfg.release_fd)
        join_cgroups(cfg.cgroup_procs)
        set_limits(cfg)
        drop_privileges(cfg.uid)
        close_inherited_fds()
        if cfg.block_sockets:
            block_sockets()
    except BaseException as exc:  # noqa: BLE001 - report any set-up failure, never run the code
        os.write(2, f"sandbox init: could not start the program: {exc!r}\n".encode())
        os._exit(125)
    del cfg
    run_main()


if __name__ == "__main__":
    main()
