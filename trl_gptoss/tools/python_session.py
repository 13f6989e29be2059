"""A per-conversation notebook on top of the stateless python sandbox.

GPT-OSS's builtin ``python`` tool is described to the model as "a stateful Jupyter notebook environment": a
variable defined in one call is expected to exist in the next. ``PythonSandbox`` runs every call in a fresh
process, so ``PythonSession`` keeps the cells a conversation has run and executes, in one sandbox call, the
earlier cells with their output discarded and then the new cell. Like a notebook, the new cell's last
expression is echoed (``repr``) when it is not None.

Replaying is exact for deterministic cells; a cell that draws random numbers, reads the clock or writes
files draws, reads and writes again on every replay (a limit this design accepts: no process stays alive
between calls, so nothing can leak between conversations or outlive a rollout). Every replay counts against
the same sandbox limits as the new cell.

**The guard lives in the host.** A replayed cell is model code running in the program's own process, so it can
end that process in more ways than any in-process guard can wrap (``os._exit`` reached through a closure or
``import __main__``, ``faulthandler._sigsegv()``, a stack overflow, a timer or thread set to fire later, a
signal), and an earlier version's guard was bypassed by each. So the program only reports, and the host
decides: after each replayed cell the program cancels what that cell armed to act later (interval timers,
``alarm``, ``threading.Timer``), checks that nothing else of it is still running (no other thread, no child
process and, under bubblewrap, no other process in the sandbox), and writes a progress marker carrying a
per-call secret; right before the new cell it writes a "started" marker, and when the new cell gives control
back (finishes, raises, ``sys.exit``) with nothing left running, a "done" marker. The host strips the markers
and

- records the new cell for replay only with "done" and no limit hit (timeout, output cap, a kill signal): a
  cell that ends its process, or leaves a thread or process running, is not replayed;
- when the replay did not reach the new cell (no "started": a replayed cell ended the process, left something
  running, or ran out the clock), drops the first cell without a progress marker from the notebook and runs
  the call again, at most ``MAX_REPAIRS`` times; then it resets the notebook and runs the new cell alone. The
  model reads a ``[sandbox]`` notice naming the cells dropped. So no cell can silently disable the cells
  after it.

What stays possible: a cell that deliberately searches the notebook program's own frames for the secret can
forge markers and break its own conversation's notebook (never the sandbox's isolation, nor another
conversation). Under ``isolation="process"`` a daemon that leaves the process tree is not seen.
"""

from __future__ import annotations

import dataclasses
import re
import secrets

from trl_gptoss.tools.result import ToolResult

MAX_REPAIRS = 3  # calls a session re-runs, each without one more cell, before it resets the notebook
# Runs inside the sandbox. Everything the notebook calls once cells have run is bound as a local of
# ``_notebook`` before the first cell: a cell can rebind module attributes and builtins, not this frame.
_NOTEBOOK_TEMPLATE = """\
def _notebook(cells, marker):
    import ast, io, linecache, os, signal, sys, threading, time, traceback
    write, dup, dup2, close, open_fd, listdir = os.write, os.dup, os.dup2, os.close, os.open, os.listdir
    getpid, getppid, devnull, write_only = os.getpid, os.getppid, os.devnull, os.O_WRONLY
    setitimer, interval_timers = signal.setitimer, (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)
    threads, timer_class, monotonic, sleep = threading.enumerate, threading.Timer, time.monotonic, time.sleep
    string_io, parse_flag, expr_node, expression_node = io.StringIO, ast.PyCF_ONLY_AST, ast.Expr, ast.Expression
    source_cache, print_exception = linecache.cache, traceback.print_exception
    compile_, exec_, eval_, repr_, print_, open_, len_, isinstance_, enumerate_, str_ = (
        compile, exec, eval, repr, print, open, len, isinstance, enumerate, str)
    base_exception, system_exit, sys_module = BaseException, SystemExit, sys
    namespace = dict(__name__="__main__", __builtins__=__builtins__)
    me = getpid()
    try:
        os.unlink("main.py")  # this program's text holds the secret: not for the cells to read
    except OSError:
        pass

    def children(pid):
        found = []
        for task in listdir("/proc/%d/task" % pid):
            with open_("/proc/%d/task/%s/children" % (pid, task)) as f:
                found += f.read().split()
        return found

    def settled():
        # Cancel what would act later, then require that nothing else of the cells is running.
        for which in interval_timers:
            setitimer(which, 0)
        for thread in threads():
            if isinstance_(thread, timer_class):
                thread.cancel()
        deadline = monotonic() + 0.1
        while len_(listdir("/proc/self/task")) > 1 and monotonic() < deadline:
            sleep(0.002)  # threads that are just ending (a cancelled Timer, a joined pool)
        if len_(listdir("/proc/self/task")) > 1 or children(me):
            return False
        return getppid() != 1 or children(1) == [str_(me)]  # under bubblewrap: no daemon adopted by PID 1

    def run(source, name, echo):
        source_cache[name] = (len_(source), None, source.splitlines(True), name)  # source lines in tracebacks
        tree = compile_(source, name, "exec", flags=parse_flag)
        last = None
        if echo and tree.body and isinstance_(tree.body[-1], expr_node):
            last = expression_node(tree.body.pop().value)
        exec_(compile_(tree, name, "exec"), namespace)
        if last is not None:
            value = eval_(compile_(last, name, "eval"), namespace)
            if value is not None:
                print_(repr_(value))

    def report(what):
        try:
            sys_module.stdout.flush(); sys_module.stderr.flush()
        except base_exception:
            pass
        write(2, (marker % what).encode())

    for index, source in enumerate_(cells[:-1]):
        sys_module.stdout.flush(); sys_module.stderr.flush()
        saved = (dup(1), dup(2), sys_module.stdout, sys_module.stderr)
        null = open_fd(devnull, write_only)
        dup2(null, 1); dup2(null, 2)  # silence subprocesses and C extensions as well
        sys_module.stdout, sys_module.stderr = string_io(), string_io()
        try:
            run(source, "<cell %d>" % index, False)
        except base_exception:
            pass  # the original call already showed this error to the model
        finally:
            sys_module.stdout, sys_module.stderr = saved[2], saved[3]
            dup2(saved[0], 1); dup2(saved[1], 2)
            for fd in (null, saved[0], saved[1]):
                close(fd)
        if not settled():
            return 125  # this cell left something running: the host drops it
        report(index)
    report("started")
    name = "<cell %d>" % (len_(cells) - 1)
    try:
        run(cells[-1], name, True)
    except system_exit:
        raise
    except base_exception as error:
        frame = error.__traceback__
        while frame is not None and not frame.tb_frame.f_code.co_filename.startswith("<cell"):
            frame = frame.tb_next  # hide the notebook's frames: the model sees its own code only
        print_exception(type(error), error, frame)
        return 1
    finally:
        if settled():
            report("done")
    return 0


raise SystemExit(_notebook({cells}, {marker!r}))
"""
_MARKER = re.compile(r"<notebook ([0-9a-f]{32}) (\d+|started|done)>")


@dataclasses.dataclass(frozen=True)
class _Progress:
    replayed: int  # earlier cells replayed with nothing left running
    started: bool  # the new cell began
    done: bool  # the new cell gave control back with nothing left running


def notebook_program(earlier_cells: list[str], code: str, secret: str = "0" * 32) -> str:
    """The one sandbox program that replays ``earlier_cells`` silently, then runs ``code`` visibly.

    It writes ``<notebook SECRET i>`` to stderr after replaying cell ``i``, ``<notebook SECRET started>``
    before ``code`` and ``<notebook SECRET done>`` when ``code`` gave control back with nothing left running.
    """
    for cell in (*earlier_cells, code):
        if not isinstance(cell, str):
            raise ValueError(f"python cells must be str, got {type(cell).__name__}")
    if not re.fullmatch(r"[0-9a-f]{32}", secret):
        raise ValueError("secret must be 32 lowercase hex digits")
    marker = f"<notebook {secret} %s>"
    return _NOTEBOOK_TEMPLATE.format(cells=repr([*earlier_cells, code]), marker=marker)


def _progress(result: ToolResult, secret: str) -> tuple[ToolResult, _Progress]:
    """``result`` with this call's markers removed from stderr, and what they said."""
    replayed, started, done = 0, False, False
    for match in _MARKER.finditer(result.stderr):
        if match[1] != secret:
            continue
        if match[2] == "started":
            started = True
        elif match[2] == "done":
            done = True
        else:
            replayed = max(replayed, int(match[2]) + 1)
    stderr = _MARKER.sub(lambda m: "" if m[1] == secret else m[0], result.stderr)
    return dataclasses.replace(result, stderr=stderr), _Progress(replayed, started, done)


def _replayable(result: ToolResult, progress: _Progress) -> bool:
    killed = result.exit_code is None or result.exit_code < 0
    return progress.done and not (result.timed_out or result.truncated or killed)


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

    def _execute(self, code: str) -> tuple[ToolResult, _Progress]:
        secret = secrets.token_hex(16)
        return _progress(self.tool.run_code(notebook_program(self.cells, code, secret)), secret)

    def run(self, code: str) -> ToolResult:
        result, progress = self._execute(code)
        dropped: list[int] = []
        original = list(range(len(self.cells)))  # each kept cell's number in the notebook as the model saw it
        while not progress.started and len(dropped) < MAX_REPAIRS and progress.replayed < len(self.cells):
            dropped.append(original.pop(progress.replayed))
            del self.cells[progress.replayed]
            result, progress = self._execute(code)
        notice = ""
        if dropped:
            notice = f"earlier cell(s) {', '.join(map(str, dropped))} stopped this notebook when replayed; dropped"
        if not progress.started and self.cells:
            self.cells = []  # still not replayable: start the notebook over rather than lose every later cell
            result, progress = self._execute(code)
            notice = "earlier cells stopped this notebook when replayed; it was reset, its variables are gone"
        if _replayable(result, progress):
            self.cells.append(code)
        return dataclasses.replace(result, notice=notice) if notice else result

    def call(self, arguments: str | dict) -> ToolResult:
        """One call of the conversation: ``arguments`` is a python call body (see ``PythonTool.code_from_body``)."""
        return self.run(self.tool.code_from_body(arguments))
