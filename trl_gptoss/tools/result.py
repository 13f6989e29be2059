"""Limits of one sandboxed call and the result the model sees."""

from __future__ import annotations

from dataclasses import asdict, dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits applied to every call (each a hard limit; the call is killed when one is hit).

    ``wall_seconds`` bounds the whole call (start-up included); ``cpu_seconds`` is ``RLIMIT_CPU`` per
    process; ``address_space_bytes`` is ``RLIMIT_AS`` (virtual memory, so keep headroom for imports such
    as numpy: 512 MiB is enough for numpy/sympy); ``max_processes`` is ``RLIMIT_NPROC`` counted for the
    call's own uid (threads count too); ``file_size_bytes`` is ``RLIMIT_FSIZE``; ``disk_bytes`` is the
    size of each private tmpfs (``/tmp``, ``/dev/shm``, ``/var/tmp``; namespace isolation only);
    ``output_bytes`` caps stdout and stderr captured together: past it the call is killed and marked
    truncated, so 100 MB of output never piles up in memory. ``memory_bytes`` is the whole call's memory
    (all its processes together, a memory cgroup; ``max_processes`` is also its ``pids.max``), applied
    when the host lets us create cgroups (see ``cgroups.py``).
    """

    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    address_space_bytes: int = 1024 * MIB
    max_processes: int = 32
    file_size_bytes: int = 16 * MIB
    disk_bytes: int = 64 * MIB
    open_files: int = 64
    output_bytes: int = 64 * 1024
    memory_bytes: int = 1024 * MIB

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}.")
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
            raise ValueError(
                "SandboxLimits.max_processes must be at least 2 (Python may start a helper thread)."
            )


@dataclass(frozen=True)
class ToolResult:
    """What one call produced.

    ``exit_code``: the program's exit status; negative ``-N`` when it was killed by signal ``N`` (the
    sandbox reports ``128 + N`` from inside a PID namespace, translated back here, so a program that calls
    ``sys.exit(137)`` reads as ``-9`` under namespace isolation). ``timed_out``: the wall
    clock limit was hit. ``truncated``: output passed ``SandboxLimits.output_bytes`` (the call was stopped
    there). ``wall_time``: seconds from launch to cleanup done. ``isolation``: ``"namespaces"`` or
    ``"process"`` (see ``docs/tools_and_rewards.md``).
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    wall_time: float
    isolation: str = "namespaces"

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.truncated

    def render(self, max_chars: int = 4000) -> str:
        """The text the model sees: stdout, then stderr (tracebacks), then notices; at most ``max_chars``."""
        if max_chars < 200:
            raise ValueError(f"max_chars={max_chars} is too small to hold a notice; use at least 200.")
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.stderr.strip():
            parts.append(self.stderr.rstrip("\n"))
        notices = []
        if self.timed_out:
            notices.append(f"[timed out after {self.wall_time:.1f} s; the program was killed]")
        if self.truncated:
            notices.append("[output limit reached; the program was stopped and its output truncated]")
        if self.exit_code not in (0, None) and not self.timed_out and not self.truncated:
            notices.append(_exit_notice(self.exit_code))
        if not parts and not notices:
            notices.append("[no output]")
        notice = "\n".join(notices)
        body = _clip("\n".join(parts), max_chars - len(notice) - 1)
        return "\n".join(p for p in (body, notice) if p)

    def to_message(self, name: str = "python", max_chars: int = 4000) -> dict:
        """The Harmony/TRL tool message: ``{"role": "tool", "name": name, "content": text}``."""
        return {"role": "tool", "name": name, "content": self.render(max_chars)}


_SIGNAL_HINTS = {
    9: " (SIGKILL: e.g. the memory limit)",
    24: " (SIGXCPU: CPU time limit)",
    25: " (SIGXFSZ: file size limit)",
    11: " (SIGSEGV)",
}


def _exit_notice(code: int) -> str:
    if code < 0:
        return f"[killed by signal {-code}{_SIGNAL_HINTS.get(-code, '')}]"
    return f"[exit status {code}]"


def _clip(text: str, budget: int) -> str:
    """Keep the head and the tail (errors are usually last) when ``text`` exceeds ``budget`` characters."""
    if len(text) <= budget:
        return text
    marker = "\n[... {} characters omitted ...]\n"
    keep = max(budget - len(marker.format(len(text))), 0)
    head, tail = keep // 2, keep - keep // 2
    omitted = len(text) - head - tail
    return text[:head] + marker.format(omitted) + (text[-tail:] if tail else "")
