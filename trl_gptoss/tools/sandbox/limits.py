"""``SandboxLimits``: the resource limits of one sandboxed call."""

from __future__ import annotations

from dataclasses import asdict, dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits applied to every call (each a hard limit; the call is killed when one is hit).

    ``wall_seconds`` bounds the whole call (start-up included); ``cpu_seconds`` is ``RLIMIT_CPU`` per
    process; ``cpu_cores`` caps the CPU of the whole call (all its processes together) at that many cores'
    worth of time, as a cgroup CPU quota (``cpu.cfs_quota_us`` = ``cpu_cores`` x the period): a call that forks
    ``max_processes`` busy loops still gets ``cpu_cores`` cores. ``address_space_bytes`` is ``RLIMIT_AS``
    (virtual memory, so keep headroom for imports such as numpy: 512 MiB is enough for numpy/sympy);
    ``max_processes`` is the call's ``pids.max`` and its ``RLIMIT_NPROC`` (threads count too);
    ``file_size_bytes`` is ``RLIMIT_FSIZE``; ``disk_bytes`` is the size of each private tmpfs (``/tmp``,
    ``/dev/shm``, ``/mnt/data``) and ``disk_files`` its inode cap (``nr_inodes``: files, directories and
    links together; applied where the host may mount, see ``PythonSandbox.disk_files_capped``);
    ``output_bytes`` caps stdout and stderr captured together: past it the call is killed and marked
    truncated, so 100 MB of output never piles up in memory. ``memory_bytes`` is the whole call's memory
    (all its processes together, a memory cgroup). The three cgroup limits apply when the host lets us
    create cgroups (``PythonSandbox.cgroups`` says which; see ``docs/tools_and_rewards.md``).
    """

    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    address_space_bytes: int = 1024 * MIB
    max_processes: int = 32
    file_size_bytes: int = 16 * MIB
    disk_bytes: int = 64 * MIB
    disk_files: int = 16384
    open_files: int = 64
    output_bytes: int = 64 * 1024
    memory_bytes: int = 1024 * MIB
    cpu_cores: float = 1.0

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}.")
            if name not in ("wall_seconds", "cpu_cores") and not isinstance(value, int):
                raise ValueError(f"SandboxLimits.{name} must be an int, got {value!r}.")
        if self.address_space_bytes < 64 * MIB:
            raise ValueError(
                f"SandboxLimits.address_space_bytes={self.address_space_bytes} cannot start Python; "
                "use at least 64 MiB (256 MiB or more to import numpy)."
            )
        if self.memory_bytes < 64 * MIB:
            raise ValueError(
                f"SandboxLimits.memory_bytes={self.memory_bytes} cannot hold a Python process; "
                "use at least 64 MiB (256 MiB or more to import numpy)."
            )
        if self.max_processes < 2:
            raise ValueError("SandboxLimits.max_processes must be at least 2 (Python may start a helper thread).")
        if self.cpu_cores < 0.01:
            raise ValueError(f"SandboxLimits.cpu_cores={self.cpu_cores} is below the 0.01 core a quota can give.")
