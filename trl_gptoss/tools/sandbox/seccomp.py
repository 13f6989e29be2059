"""A seccomp filter for sandboxed calls: a classic-BPF program handed to bubblewrap (``--seccomp FD``).

Bubblewrap installs it just before it execs the call's interpreter (and in its own PID 1), so it binds every
process of the call and cannot be removed. It is a deny-list of kernel surface that model-written Python
never needs and that sandbox escapes are built on; everything else is allowed (an allow-list of syscalls
would break numpy/sympy/multiprocessing on kernel or libc updates):

- namespaces and mounts: ``unshare``, ``setns``, ``clone``/``clone3`` with any ``CLONE_NEW*`` flag
  (``clone3`` is refused with ``ENOSYS`` so libc falls back to ``clone``, whose flags BPF can read), ``mount``
  and the new mount API, ``pivot_root``, ``chroot``;
- other processes' memory and files: ``ptrace``, ``process_vm_readv/writev``, ``process_madvise``,
  ``pidfd_getfd``, ``kcmp``;
- kernel attack surface: ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_*``, ``keyctl`` and
  friends, ``open_by_handle_at``, modules, ``kexec``, ``syslog``, ``personality``, ``memfd_secret``, swap,
  reboot, and on x86-64 ``modify_ldt`` (refused by Docker's default profile too), ``iopl``, ``ioperm``, ...;
- sockets other than ``AF_UNIX``/``AF_INET``/``AF_INET6`` (netlink, vsock, packet, ... fail with
  ``EAFNOSUPPORT``; the network namespace already has no interface but its own loopback);
- ``ioctl(TIOCSTI)`` (typing into a terminal).

Denied calls fail with ``EPERM`` (the program sees an ordinary ``PermissionError``); a syscall of another
ABI (x32, or a foreign architecture) kills the process.
"""

from __future__ import annotations

import errno
import platform
import struct

# BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h, linux/audit.h).
LD_W_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
NR_OFFSET, ARCH_OFFSET, ARG0_OFFSET, ARG1_OFFSET = 0, 4, 16, 24  # struct seccomp_data (low 32 bits of args)
X32_SYSCALL_BIT = 0x40000000
CLONE_NEW_FLAGS = 0x7E020000  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET (NEWTIME needs clone3/unshare)
ALLOWED_SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
TIOCSTI = 0x5412

ARG_CHECKED = ("clone", "clone3", "socket", "socketpair", "ioctl")  # filtered on their arguments below

# (audit arch, syscall numbers) per machine: x86_64 from asm/unistd_64.h, aarch64 from asm-generic/unistd.h.
_ARCHES = {
    "x86_64": (
        0xC000003E,
        {
            "ptrace": 101,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "pidfd_getfd": 438,
            "mount": 165,
            "umount2": 166,
            "pivot_root": 155,
            "chroot": 161,
            "open_tree": 428,
            "move_mount": 429,
            "fsopen": 430,
            "fsconfig": 431,
            "fsmount": 432,
            "fspick": 433,
            "mount_setattr": 442,
            "unshare": 272,
            "setns": 308,
            "swapon": 167,
            "swapoff": 168,
            "reboot": 169,
            "sethostname": 170,
            "setdomainname": 171,
            "init_module": 175,
            "finit_module": 313,
            "delete_module": 176,
            "kexec_load": 246,
            "kexec_file_load": 320,
            "acct": 163,
            "quotactl": 179,
            "quotactl_fd": 443,
            "bpf": 321,
            "perf_event_open": 298,
            "userfaultfd": 323,
            "keyctl": 250,
            "add_key": 248,
            "request_key": 249,
            "open_by_handle_at": 304,
            "name_to_handle_at": 303,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "syslog": 103,
            "lookup_dcookie": 212,
            "vhangup": 153,
            "personality": 135,
            "fanotify_init": 300,
            "modify_ldt": 154,
            "memfd_secret": 447,
            "iopl": 172,
            "ioperm": 173,
            "kcmp": 312,
            "process_madvise": 440,
            "clone": 56,
            "clone3": 435,
            "socket": 41,
            "socketpair": 53,
            "ioctl": 16,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "ptrace": 117,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "pidfd_getfd": 438,
            "mount": 40,
            "umount2": 39,
            "pivot_root": 41,
            "chroot": 51,
            "open_tree": 428,
            "move_mount": 429,
            "fsopen": 430,
            "fsconfig": 431,
            "fsmount": 432,
            "fspick": 433,
            "mount_setattr": 442,
            "unshare": 97,
            "setns": 268,
            "swapon": 224,
            "swapoff": 225,
            "reboot": 142,
            "sethostname": 161,
            "setdomainname": 162,
            "init_module": 105,
            "finit_module": 273,
            "delete_module": 106,
            "kexec_load": 104,
            "kexec_file_load": 294,
            "acct": 89,
            "quotactl": 60,
            "quotactl_fd": 443,
            "bpf": 280,
            "perf_event_open": 241,
            "userfaultfd": 282,
            "keyctl": 219,
            "add_key": 217,
            "request_key": 218,
            "open_by_handle_at": 265,
            "name_to_handle_at": 264,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "syslog": 116,
            "lookup_dcookie": 18,
            "vhangup": 58,
            "personality": 92,
            "fanotify_init": 262,
            "memfd_secret": 447,
            "kcmp": 272,
            "process_madvise": 440,
            "clone": 220,
            "clone3": 435,
            "socket": 198,
            "socketpair": 199,
            "ioctl": 29,
        },
    ),
}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _errno(code: int) -> int:
    return RET_ERRNO | code


def _deny_if(nr: int, ret: int) -> list[bytes]:
    """``if syscall == nr: return ret`` (the accumulator holds the syscall number)."""
    return [_insn(JEQ, nr, 0, 1), _insn(RET, ret)]


def _check_arg(nr: int, offset: int, body: list[bytes]) -> list[bytes]:
    """``if syscall == nr: {load the argument at offset; body (returns or falls through)}``, then reload nr."""
    block = [_insn(LD_W_ABS, offset), *body, _insn(LD_W_ABS, NR_OFFSET)]
    return [_insn(JEQ, nr, 0, len(block)), *block]


def build_filter(machine: str | None = None) -> bytes:
    """The filter for ``machine`` (default: this host's) as ``struct sock_filter[]`` bytes."""
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        raise ValueError(
            f"no seccomp syscall table for machine {machine!r} (have {sorted(_ARCHES)}); "
            "use PythonSandbox(seccomp=False) to run without the filter."
        )
    arch, nr = _ARCHES[machine]
    eperm = _errno(errno.EPERM)
    prog = [_insn(LD_W_ABS, ARCH_OFFSET), _insn(JEQ, arch, 1, 0), _insn(RET, RET_KILL_PROCESS)]
    prog += [_insn(LD_W_ABS, NR_OFFSET)]
    if machine == "x86_64":
        prog += [_insn(JGE, X32_SYSCALL_BIT, 0, 1), _insn(RET, RET_KILL_PROCESS)]
    for name, number in nr.items():
        if name not in ARG_CHECKED:
            prog += _deny_if(number, eperm)
    prog += _deny_if(nr["clone3"], _errno(errno.ENOSYS))
    new_namespace = [_insn(JSET, CLONE_NEW_FLAGS, 0, 1), _insn(RET, eperm)]
    prog += _check_arg(nr["clone"], ARG0_OFFSET, new_namespace)
    # After the JEQs, a match jumps over the remaining JEQs and the RET to the reload of the syscall number.
    family_check = [
        _insn(JEQ, f, len(ALLOWED_SOCKET_FAMILIES) - i, 0) for i, f in enumerate(ALLOWED_SOCKET_FAMILIES)
    ] + [_insn(RET, _errno(errno.EAFNOSUPPORT))]
    prog += _check_arg(nr["socket"], ARG0_OFFSET, family_check)
    unix_only = [_insn(JEQ, ALLOWED_SOCKET_FAMILIES[0], 1, 0), _insn(RET, _errno(errno.EAFNOSUPPORT))]
    prog += _check_arg(nr["socketpair"], ARG0_OFFSET, unix_only)
    prog += _check_arg(nr["ioctl"], ARG1_OFFSET, [_insn(JEQ, TIOCSTI, 0, 1), _insn(RET, eperm)])
    prog += [_insn(RET, RET_ALLOW)]
    return b"".join(prog)
