"""A per-conversation notebook on top of the stateless python sandbox.

GPT-OSS's builtin ``python`` tool is described to the model as "a stateful Jupyter notebook environment"
(``trl_gptoss.harmony`` renders that description): a variable defined in one call is expected to exist in
the next. ``PythonSandbox`` runs every call in a fresh process, so ``PythonSession`` keeps the cells a
conversation has run and executes, in one sandbox call, the earlier cells with their output discarded and
then the new cell. Like a notebook, the new cell's last expression is echoed (``repr``) when it is not None.

Replaying is exact for deterministic cells; a cell that draws random numbers, reads the clock or writes
files draws, reads and writes again on every replay (a limit this design accepts: no process stays alive
between calls, so nothing can leak between conversations or outlive a rollout). Every replay counts against
the same sandbox limits as the new cell. Cells that hit a limit (timeout, output cap, a kill signal) are not
replayed, so one runaway cell cannot poison the rest of the conversation.
"""

from __future__ import annotations

import json

from trl_gptoss.tools import PythonTool, ToolResult

# Runs inside the sandbox. Names start with an underscore so that model code rarely collides with them.
_NOTEBOOK_TEMPLATE = """\
import ast as _ast, io as _io, linecache as _lc, os as _os, sys as _sys, traceback as _tb
_CELLS = {cells}
_NS = {{"__name__": "__main__", "__builtins__": __builtins__}}


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
    try:
        _run(_src, _name, False)
    except BaseException:
        pass  # the original call already showed this error to the model
    finally:
        _sys.stdout, _sys.stderr = _saved[2], _saved[3]
        _os.dup2(_saved[0], 1); _os.dup2(_saved[1], 2)
        for _fd in (_null, _saved[0], _saved[1]):
            _os.close(_fd)


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
"""


def notebook_program(earlier_cells: list[str], code: str) -> str:
    """The one sandbox program that replays ``earlier_cells`` silently, then runs ``code`` visibly."""
    for cell in (*earlier_cells, code):
        if not isinstance(cell, str):
            raise ValueError(f"python cells must be str, got {type(cell).__name__}")
    return _NOTEBOOK_TEMPLATE.format(cells=repr([*earlier_cells, code]))


def _replayable(result: ToolResult) -> bool:
    killed = result.exit_code is None or result.exit_code < 0
    return not (result.timed_out or result.truncated or killed)


class PythonSession:
    """One conversation's python state: ``run(code)`` behaves like executing a new notebook cell.

    Uses only ``PythonTool.call`` (a raw code body), so the tool's sandbox, limits and isolation apply
    unchanged. Not thread-safe: a conversation runs one call at a time.
    """

    def __init__(self, tool: PythonTool):
        if not isinstance(tool, PythonTool):
            raise ValueError(f"PythonSession needs a trl_gptoss.tools.PythonTool, got {type(tool).__name__}")
        self.tool = tool
        self.cells: list[str] = []

    def run(self, code: str) -> ToolResult:
        result = self.tool.call(notebook_program(self.cells, code))
        if _replayable(result):
            self.cells.append(code)
        return result


def python_code_from_body(tool: PythonTool, body: str) -> str:
    """The code of a python call: the raw body (``to=python``) or ``{"code": ...}`` (``to=functions.python``).

    Same rule as ``PythonTool.call``: a JSON object with a ``code`` key is the function form (checked against
    the tool's schema, ``ValueError`` says what is wrong); any other body is code.
    """
    stripped = body.strip()
    if stripped.startswith("{") and stripped.endswith("}"):
        try:
            parsed = json.loads(stripped)
        except json.JSONDecodeError:
            return body
        if isinstance(parsed, dict) and "code" in parsed:
            return tool.parse_arguments(parsed)["code"]
    return body
