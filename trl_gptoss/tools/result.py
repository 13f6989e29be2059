"""What one tool call produced, and the text the model sees of it.

The program's output is untrusted text: ``clean_output`` decodes it and turns control bytes (NUL, escape
sequences, other C0/C1 controls, DEL) into visible ``\\xNN`` text, and the Unicode line and paragraph
separators (U+2028, U+2029) and invisible format characters (BOM U+FEFF, zero-width and bidi marks: category
``Cf``) into visible ``\\uXXXX`` text, so ``"\\n"`` is the only line break a program can print. The
sandbox's own notices are lines starting with ``[sandbox]``; a program line that would read as one (after
NFKC normalisation, so full-width brackets count, and after any leading whitespace) is shown with a
leading backslash, so the model can trust every notice line it sees.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

NOTICE_TAG = "[sandbox]"
_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)] if c not in (0x09, 0x0A)}


class _VisibleTable(dict):
    """``str.translate`` table: C0/C1 controls -> ``\\xNN``; separators and format characters (categories
    ``Zl``, ``Zp``, ``Cf``) -> ``\\uXXXX``; anything else maps to itself. Filled lazily per character seen."""

    def __missing__(self, code: int) -> str:
        char = chr(code)
        value = f"\\u{code:04x}" if unicodedata.category(char) in ("Cf", "Zl", "Zp") else char
        self[code] = value
        return value


_VISIBLE = _VisibleTable(_CONTROLS)


def clean_output(data: bytes) -> str:
    """UTF-8 text of a program's output with control, separator and format characters (but tab and
    newline) made visible."""
    text = data.decode("utf-8", "replace").replace("\r\n", "\n")
    return text.translate(_VISIBLE)


def _looks_like_notice(line: str) -> bool:
    return unicodedata.normalize("NFKC", line).lstrip().lower().startswith(NOTICE_TAG)


def _escape_notice_lookalikes(text: str) -> str:
    """Make separators visible, then prefix every line that would read as a notice with a backslash."""
    text = text.translate(_VISIBLE)  # text built outside clean_output may still hold U+2028 or a BOM
    return "\n".join("\\" + line if _looks_like_notice(line) else line for line in text.split("\n"))


@dataclass(frozen=True)
class ToolResult:
    """What one call produced.

    ``exit_code``: the program's exit status; negative ``-N`` when it was killed by signal ``N`` (the
    sandbox reports ``128 + N`` from inside a PID namespace, translated back here, so a program that calls
    ``sys.exit(137)`` reads as ``-9`` under namespace isolation). ``timed_out``: the wall
    clock limit was hit. ``truncated``: output passed ``SandboxLimits.output_bytes`` (the call was stopped
    there). ``wall_time``: seconds from launch to cleanup done. ``isolation``: ``"namespaces"`` or
    ``"process"`` (see ``docs/tools_and_rewards.md``). ``notice``: what the sandbox tells the model about this
    call besides its output (why it did not run the program, notebook cells it dropped), shown first among
    the ``[sandbox]`` notices; ``""`` for nothing.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    wall_time: float
    isolation: str = "namespaces"
    notice: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.truncated

    def render(self, max_chars: int = 4000) -> str:
        """The text the model sees: stdout, then stderr (tracebacks), then the sandbox's notices (lines that
        start with ``[sandbox]``, which program text never does); at most ``max_chars`` characters."""
        if max_chars < 200:
            raise ValueError(f"max_chars={max_chars} is too small to hold a notice; use at least 200.")
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.stderr.strip():
            parts.append(self.stderr.rstrip("\n"))
        notices = [f"{NOTICE_TAG} {self.notice}"] if self.notice else []
        if self.timed_out:
            notices.append(f"{NOTICE_TAG} timed out after {self.wall_time:.1f} s; the program was killed")
        if self.truncated:
            notices.append(f"{NOTICE_TAG} output limit reached; the program was stopped and its output truncated")
        if self.exit_code not in (0, None) and not self.timed_out and not self.truncated:
            notices.append(_exit_notice(self.exit_code))
        if not parts and not notices:
            notices.append(f"{NOTICE_TAG} no output")
        notice = "\n".join(notices)
        body = _clip(_escape_notice_lookalikes("\n".join(parts)), max_chars - len(notice) - 1)
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
        return f"{NOTICE_TAG} killed by signal {-code}{_SIGNAL_HINTS.get(-code, '')}"
    return f"{NOTICE_TAG} exit status {code}"


def _clip(text: str, budget: int) -> str:
    """Keep the head and the tail (errors are usually last) when ``text`` exceeds ``budget`` characters."""
    if len(text) <= budget:
        return text
    marker = f"\n{NOTICE_TAG} ... {{}} characters omitted ...\n"
    keep = max(budget - len(marker.format(len(text))) - 1, 0)  # - 1: room to escape the tail's first line
    head, tail = keep // 2, keep - keep // 2
    omitted = len(text) - head - tail
    tail_text = _escape_notice_lookalikes(text[-tail:]) if tail else ""  # a cut may start a line mid-way
    return text[:head] + marker.format(omitted) + tail_text
