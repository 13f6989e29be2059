"""The sandbox that runs model-written Python: ``PythonSandbox``, its ``SandboxLimits``, ``detect_isolation``.

Modules: ``runner`` (``PythonSandbox``: one call from launch to cleanup), ``preforked`` and ``zygote`` (the
pre-forked interpreter that forks each call, host and sandbox sides), ``bwrap`` (a bubblewrap per call),
``view`` (the allow-listed file system), ``userns`` (uids and user namespaces), ``cgroups`` (memory, pids,
CPU quota), ``seccomp`` (the syscall filter), ``init`` (the in-sandbox first steps and the ``CallConfig``
shared with the host), ``process`` (the weaker fallback), ``limits``.
"""

from trl_gptoss.tools.sandbox.limits import SandboxLimits
from trl_gptoss.tools.sandbox.runner import PythonSandbox, detect_isolation
from trl_gptoss.tools.sandbox.userns import UserNamespaceError

__all__ = ["PythonSandbox", "SandboxLimits", "UserNamespaceError", "detect_isolation"]
