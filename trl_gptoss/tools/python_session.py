"""A per-conversation notebook on top of the stateless python sandbox.

GPT-OSS's builtin ``python`` tool is described to the model as "a stateful Jupyter notebook environment": a
variable defined in one call is expected to exist in the next. ``PythonSandbox`` runs every call in a fresh
process, so ``PythonSession`` keeps the cells a conversation has run and executes, in one sandbox call, the
earlier cells with their output discarded and then the new cell. Like a notebook, the new cell's last
expression is echoed (``repr``) when it is not None.

Replaying is exact for deterministic cells; a cell that draws random numbers, reads the clock or writes
files draws, reads and writes again on every replay (a limit this design accepts: no process stays alive
between calls, so nothing can leak between conversations or outlive a rollout). Every replay counts against
the same sandbox limits as the new cell. A cell is recorded for replay only when it gave control back to the
notebook program (it finished, raised, or called ``sys.exit``) and hit no limit (timeout, output cap, a kill
signal): a cell that ended its process (``os._exit``, ``os.abort``, a signal to itself, ``exec``) is not
replayed. While earlier cells replay, those process-ending calls raise inside the cell instead, so a cell
that only ends the process on a later run cannot end the replay either.
"""

from __future__ import annotations

import dataclasses
import secrets

from trl_gptoss.tools.result import ToolResult

# Runs inside the sandbox. Names start with an underscore so that model code rarely collides with them.
_NOTEBOOK_TEMPLATE = """\
import ast as _ast, io as _io, linecache as _lc, os as _os, posix as _posix, signal as _signal, sys as _sys
import traceback as _tb
_CELLS = {cells}
_DONE = {done!r}
_NS = {{"__name__": "__main__", "__builtins__": __builtins__}}
_REPLAYING = [False]


class _ReplayStop(BaseException):
    pass  # raised instead of ending the process while an earlier cell replays


def _ends_this_process(_name, _args):
    if _name in ("kill", "pthread_kill"):  # kill(pid, sig): this process, its group, its parent or everyone
        return _name == "pthread_kill" or _args[0] in (0, 1, _os.getpid(), _os.getppid()) or _args[0] < 0
    return True


def _guard(_module, _name):
    _real = getattr(_module, _name, None)
    if _real is None:
        return

    def _guarded(*_args, **_kwargs):
        if _REPLAYING[0] and _ends_this_process(_name, _args):
            raise _ReplayStop(_name)
        return _real(*_args, **_kwargs)

    setattr(_module, _name, _guarded)


for _module in (_os, _posix):
    for _name in ("_exit", "abort", "kill", "killpg", "fork", "forkpty", "execv", "execve"):
        _guard(_module, _name)
    for _name in ("execl", "execle", "execlp", "execlpe", "execvp", "execvpe"):
        _guard(_module, _name)
for _name in ("raise_signal", "pthread_kill"):
    _guard(_signal, _name)


def _run(_src, _name, _echo):
    _lc.cache[_name] = (len(_src), None, _src.splitlines(True), _name)  # source lines in tracebacks
    _tree = compile(_src, _name, "exec", flags=_ast.PyCF_ONLY_AST)
    _last = None
    if _echo and _tree.body and isinstance(_tree.body[-1], _ast.Expr):
        _last = _ast.Expression(_tree.body.pop().value)
    exec(compile(_tree, _name, "exec"), _NS)
    if _last is not None:
        _value = eval(compile(_last, _name, "eval"), _NS)
        if _value is not None:
            print(repr(_value))


def _replay(_src, _name):
    _sys.stdout.flush(); _sys.stderr.flush()
    _saved = (_os.dup(1), _os.dup(2), _sys.stdout, _sys.stderr)
    _null = _os.open(_os.devnull, _os.O_WRONLY)
    _os.dup2(_null, 1); _os.dup2(_null, 2)  # silence subprocesses and C extensions as well
    _sys.stdout, _sys.stderr = _io.StringIO(), _io.StringIO()
    _REPLAYING[0] = True
    try:
        _run(_src, _name, False)
    except BaseException:
        pass  # the original call already showed this error to the model
    finally:
        _REPLAYING[0] = False
        _sys.stdout, _sys.stderr = _saved[2], _saved[3]
        _os.dup2(_saved[0], 1); _os.dup2(_saved[1], 2)
        for _fd in (_null, _saved[0], _saved[1]):
            _os.close(_fd)


def _done():
    try:
        _sys.stdout.flush(); _sys.stderr.flush()
        _os.write(2, _DONE)  # tells the host this cell gave control back (the host strips it)
    except BaseException:
        pass


for _i, _src in enumerate(_CELLS[:-1]):
    _replay(_src, "<cell %d>" % _i)
try:
    _run(_CELLS[-1], "<cell %d>" % (len(_CELLS) - 1), True)
except SystemExit:
    raise
except BaseException as _e:
    _t = _e.__traceback__
    while _t is not None and not _t.tb_frame.f_code.co_filename.startswith("<cell"):
        _t = _t.tb_next  # hide this wrapper's frames: the model sees its own code only
    _tb.print_exception(type(_e), _e, _t)
    _sys.exit(1)
finally:
    _done()
"""


def notebook_program(earlier_cells: list[str], code: str, done_marker: str = "") -> str:
    """The one sandbox program that replays ``earlier_cells`` silently, then runs ``code`` visibly.

    When ``code`` gives control back (finishes, raises, ``sys.exit``), the program writes ``done_marker``
    to stderr last; a cell that ends its process never does.
    """
    for cell in (*earlier_cells, code):
        if not isinstance(cell, str):
            raise ValueError(f"python cells must be str, got {type(cell).__name__}")
    return _NOTEBOOK_TEMPLATE.format(cells=repr([*earlier_cells, code]), done=done_marker.encode("ascii"))


def _without_marker(result: ToolResult, marker: str) -> tuple[ToolResult, bool]:
    """``result`` with the notebook's done marker removed from stderr, and whether the marker was there."""
    at = result.stderr.rfind(marker)
    if at < 0:
        return result, False
    return dataclasses.replace(result, stderr=result.stderr[:at] + result.stderr[at + len(marker) :]), True


def _replayable(result: ToolResult, gave_control_back: bool) -> bool:
    killed = result.exit_code is None or result.exit_code < 0
    return gave_control_back and not (result.timed_out or result.truncated or killed)


class PythonSession:
    """One conversation's python state: ``run(code)`` behaves like executing a new notebook cell.

    ``tool`` is the ``PythonTool`` that made the session (``PythonTool.new_session``): ``call(body)`` applies its
    body rule first (``code_from_body``: raw code or ``{"code": ...}``), and every program runs through its
    ``run_code``, so the tool's sandbox, limits and isolation apply unchanged. Not thread-safe: a conversation
    runs one call at a time.
    """

    def __init__(self, tool):
        if not all(callable(getattr(tool, name, None)) for name in ("run_code", "code_from_body")):
            raise ValueError(
                f"PythonSession needs a trl_gptoss.tools.PythonTool (run_code, code_from_body), "
                f"got {type(tool).__name__}"
            )
        self.tool = tool
        self.cells: list[str] = []

    def run(self, code: str) -> ToolResult:
        marker = f"<notebook cell done {secrets.token_hex(16)}>"
        result = self.tool.run_code(notebook_program(self.cells, code, marker))
        result, gave_control_back = _without_marker(result, marker)
        if _replayable(result, gave_control_back):
            self.cells.append(code)
        return result

    def call(self, arguments: str | dict) -> ToolResult:
        """One call of the conversation: ``arguments`` is a python call body (see ``PythonTool.code_from_body``)."""
        return self.run(self.tool.code_from_body(arguments))
