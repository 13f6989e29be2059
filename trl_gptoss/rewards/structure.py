"""Structural reading of a symbolic answer: two answers match when they parse to the same tree.

Comparing stripped text loses grouping (``2x+1`` vs ``2(x+1)``, ``\\sqrt{3/2}`` vs ``\\sqrt{3}/2``) and
case (``\\Pi`` vs ``\\pi``). Here an answer is tokenised (LaTeX commands, single-letter variables, numbers,
operators; spacing commands, ``\\left``/``\\right``, ``$`` and ``\\text{}`` wrappers dropped) and parsed
by precedence into a tree of nested tuples:

- ``,`` < relations (``= < > ≤ ≥ ≠ :``, ``\\in``, ``\\cup`` ..., at most one per level) < ``+ - ±`` <
  unary sign < ``* × /`` and juxtaposition < ``^``/``_`` < postfix ``! ' % °``;
- ``\\frac{a}{b}`` is ``a / b``; ``\\cdot``, ``*`` and juxtaposition are one product (``\\times`` stays
  its own operator), except a name before ``(`` (``f(x)``, ``\\pi(2)``: maybe a function applied);
- ``( )`` and ``{ }`` around one item only group (``(x+1)`` is ``x+1``), while ``[ ]``, ``\\{ \\}`` and
  any bracket holding a comma keep their kind (``(1,2]`` is an interval);
- numbers compare by exact value (``2.50`` = ``2.5``), except a leading-zero run (``000``) keeps its text.

The only equivalences are therefore those of the written grouping and precedence: no simplification, no
commutativity, so equal values written differently (``\\sqrt{8}`` vs ``2\\sqrt{2}``) do not match -- a
false negative, never a false positive. Where LaTeX and plain-text readings differ the answer is
*unreadable* (``None``): ``x^23`` (LaTeX: x^2 3), ``1/2x`` (1/(2x) or x/2?), ``\\sin 2x``, ``a/b/c``,
``1 2`` (product or thousands?), ``2\\frac{1}{2}`` (a mixed number?), ``|x|``, two relations in a row.
An unreadable answer matches only an answer with the same tokens.

Bounds: an answer longer than ``MAX_ANSWER_CHARS`` has no tokens; nesting deeper than ``MAX_DEPTH`` is
unreadable (the parser recurses once per level, far below Python's limit). Linear in the answer's length.
"""

from __future__ import annotations

import re
from fractions import Fraction

from trl_gptoss.rewards.numbers import MAX_ANSWER_CHARS

MAX_DEPTH = 40


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


_DIGITS = frozenset("0123456789")

_TOKEN = re.compile(r"([0-9]+(?:\.[0-9]+)?|\.[0-9]+)|(\\[A-Za-z]+)|(\\.)|(\s+)|(\*\*|<=|>=|!=|.)", re.DOTALL)
_DELIMITER_DOT = re.compile(r"\\(?:left|right)\s*\.")
_DEGREE = re.compile(r"\^\s*(?:\\circ|\{\s*\\circ\s*\})")
_SKIPPED_COMMANDS = _words(
    "left right bigl bigr Bigl Bigr biggl biggr big Big bigg quad qquad displaystyle textstyle limits "
    "text textrm textbf textit textnormal mathrm mathit mbox operatorname"
)
_RENAMED = {
    "\\dfrac": "\\frac", "\\tfrac": "\\frac", "\\cfrac": "\\frac", "\\dbinom": "\\binom", "\\tbinom": "\\binom",
    "\\cdot": "*", "\\ast": "*", "\\times": "×", "\\div": "/", "\\le": "≤", "\\leq": "≤", "\\leqslant": "≤",
    "\\ge": "≥", "\\geq": "≥", "\\geqslant": "≥", "\\ne": "≠", "\\neq": "≠", "\\lt": "<", "\\gt": ">",
    "\\pm": "±", "\\mp": "∓", "\\%": "%", "\\{": "\\{", "\\}": "\\}",
    "**": "^", "<=": "≤", ">=": "≥", "!=": "≠", "·": "*", "÷": "/", "\u2212": "-", "π": "\\pi", "∞": "\\infty",
}  # fmt: skip
_SKIPPED = frozenset({"$", "~", "\\,", "\\;", "\\:", "\\!", "\\ ", "\\$"})
_UNREADABLE = frozenset({"|", "\\|", "\\\\", "&", ";", "?", "\\"})
_RELATIONS = frozenset({"=", "<", ">", "≤", "≥", "≠", ":", "≈"})
_RELATION_COMMANDS = _words(
    "in notin ni subset subseteq supset supseteq cup cap setminus to rightarrow Rightarrow leftarrow "
    "leftrightarrow iff implies mapsto approx sim simeq equiv cong propto mid parallel perp wedge vee "
    "land lor oplus otimes"
)
_FUNCTIONS = _words(
    "sin cos tan sec csc cot arcsin arccos arctan sinh cosh tanh log ln lg exp det gcd lcm min max arg deg dim ker Pr"
)
_ADDITIVE = frozenset({"+", "-", "±", "∓"})
_MULTIPLICATIVE = frozenset({"*", "×", "/"})
_POSTFIX = frozenset({"!", "'", "%", "°"})
_OPENERS = {"(": ")", "{": "}", "[": "]", "\\{": "\\}"}
_CLOSERS = frozenset({")", "}", "]", "\\}"})


class _Unreadable(Exception):
    """The answer cannot be read without choosing between two meanings (or is malformed / too deep)."""


def answer_tokens(text) -> tuple[str, ...] | None:
    """The tokens of a written answer, or ``None`` for a non-string or one longer than ``MAX_ANSWER_CHARS``.

    A token is a number (``12``, ``2.5``), one ASCII letter, a LaTeX command with its canonical name
    (``\\dfrac`` -> ``\\frac``, ``\\cdot`` -> ``*``, ``\\leq`` -> ``≤``) or one other character. Spacing,
    ``$``, ``\\left``/``\\right`` and ``\\text``-like wrapper commands (not their braces) are dropped.
    """
    if not isinstance(text, str) or len(text) > MAX_ANSWER_CHARS:
        return None
    text = _DEGREE.sub("°", _DELIMITER_DOT.sub("", text.strip().rstrip(".")))
    tokens = []
    for number, command, escape, space, other in _TOKEN.findall(text):
        token = number or command or escape or other
        if space or token in _SKIPPED or command[1:] in _SKIPPED_COMMANDS:
            continue
        tokens.append(_RENAMED.get(token, token))
    return tuple(tokens)


def answer_structure(text) -> tuple | None:
    """The parse tree of a written answer (nested tuples, comparable with ``==``), or ``None`` when the
    answer is unreadable (see the module docstring)."""
    tokens = answer_tokens(text)
    if not tokens:
        return None
    try:
        return _Parser(tokens).parse()
    except (_Unreadable, RecursionError):
        return None


def same_structure(a, b) -> bool:
    """Whether two answers have the same tokens, or both parse to the same tree."""
    tokens_a, tokens_b = answer_tokens(a), answer_tokens(b)
    if not tokens_a or not tokens_b:
        return False
    if tokens_a == tokens_b:
        return True
    tree_a = answer_structure(a)
    return tree_a is not None and tree_a == answer_structure(b)


def _is_number(token: str | None) -> bool:
    return token is not None and (token[0] in _DIGITS or (token[0] == "." and len(token) > 1))


def _number(token: str) -> tuple:
    if len(token.split(".")[0]) > 1 and token[0] == "0":
        return ("num", token)  # "000" in "1,000" is not "0"
    return ("num", Fraction(token))


class _Parser:
    """Recursive descent over the token tuple, one method per precedence level (lowest first)."""

    def __init__(self, tokens: tuple[str, ...]):
        self.tokens, self.i, self.depth = tokens, 0, 0

    def peek(self, ahead: int = 0) -> str | None:
        j = self.i + ahead
        return self.tokens[j] if j < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise _Unreadable("the answer ends inside an expression")
        self.i += 1
        return token

    def expect(self, token: str) -> None:
        if self.take() != token:
            raise _Unreadable(f"expected {token!r}")

    def parse(self) -> tuple:
        items = self.items()
        if self.peek() is not None:
            raise _Unreadable(f"unexpected {self.peek()!r}")
        return items[0] if len(items) == 1 else ("list", "", tuple(items))

    def items(self) -> list:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Unreadable("nested too deeply")
        items = [self.relation()]
        while self.peek() == ",":
            self.take()
            items.append(self.relation())
        self.depth -= 1
        return items

    def relation(self) -> tuple:
        left = self.sum()
        op = self.peek()
        if op in _RELATIONS or (op is not None and op[1:] in _RELATION_COMMANDS and op[0] == "\\"):
            self.take()
            right = self.sum()
            nxt = self.peek()
            if nxt in _RELATIONS or (nxt is not None and nxt[0] == "\\" and nxt[1:] in _RELATION_COMMANDS):
                raise _Unreadable("two relations in a row")  # a < b < c, A \cup B \cap C
            return ("rel", op, left, right)
        return left

    def sum(self) -> tuple:
        node = self.signed()
        while self.peek() in _ADDITIVE:
            op = self.take()
            node = (op, node, self.signed())
        return node

    def signed(self) -> tuple:
        """Leading signs, read in a loop (a run of 400 signs must not recurse 400 times)."""
        signs = []
        while self.peek() in _ADDITIVE:
            signs.append(self.take())
        node = self.product()
        for op in reversed(signs):
            node = node if op == "+" else ("neg" if op == "-" else op, node)
        return node

    def product(self) -> tuple:
        node = self.power()
        while True:
            token = self.peek()
            if token in _MULTIPLICATIVE:
                self.take()
                right = self.signed_power()
                if token == "/" and (self.peek() == "/" or self.starts_operand(self.peek())):
                    raise _Unreadable("a/b/c and 1/2x have two readings")
                node = ("*" if token == "*" else token, node, right)
            elif self.starts_operand(token):
                node = self.juxtaposed(node, token, self.tokens[self.i - 1])
            else:
                return node

    def juxtaposed(self, node: tuple, token: str, previous: str) -> tuple:
        """``a b``: a product, except ``f(x)``/``\\pi(2)``/``f'(x)`` (maybe an application, so its own node)."""
        if _is_number(previous) and (_is_number(token) or token == "\\frac"):
            raise _Unreadable("1 2 and 2\\frac{1}{2}: a product, thousands or a mixed number?")
        right = self.power()
        named = previous == "'" or (previous[-1:].isalpha() and (len(previous) == 1 or previous[0] == "\\"))
        return ("apply" if token == "(" and named else "*", node, right)

    def signed_power(self) -> tuple:
        negated = False
        while self.peek() in ("-", "+"):
            negated ^= self.take() == "-"
        node = self.power()
        return ("neg", node) if negated else node

    @staticmethod
    def starts_operand(token: str | None) -> bool:
        if token is None or token in _CLOSERS or token in _RELATIONS or token in _ADDITIVE:
            return False
        if token in _MULTIPLICATIVE or token in _POSTFIX or token in ("^", "_", ","):
            return False
        return not (token[0] == "\\" and token[1:] in _RELATION_COMMANDS)

    def power(self) -> tuple:
        node = self.primary()
        sub = sup = None
        while self.peek() in ("^", "_"):
            kind = self.take()
            if (kind == "^" and sup is not None) or (kind == "_" and sub is not None):
                raise _Unreadable("double script")
            if kind == "^":
                sup = self.script()
            else:
                sub = self.script()
        if sub is not None:
            node = ("sub", node, sub)
        if sup is not None:
            node = ("^", node, sup)
        while self.peek() in _POSTFIX:
            node = ("post", self.take(), node)
        return node

    def script(self) -> tuple:
        """A superscript/subscript/command argument: a group, or one character as LaTeX reads it."""
        token = self.peek()
        if token in ("{", "("):
            return self.group()
        if token is None or (_is_number(token) and len(token) > 1) or not self.starts_operand(token):
            raise _Unreadable("a script or argument that LaTeX and plain text read differently")
        if token[0] == "\\" and token[1:] in _FUNCTIONS | {"frac", "sqrt", "binom"}:
            raise _Unreadable("a command as a bare argument")
        return self.primary()

    def group(self) -> tuple:
        opener = self.take()
        items = self.items()
        closer = self.take()
        if closer not in _CLOSERS:
            raise _Unreadable("unbalanced brackets")
        if len(items) == 1 and opener + closer in ("()", "{}"):
            return items[0]
        if len(items) == 1 and opener + closer not in ("[]", "\\{\\}"):
            raise _Unreadable("mismatched brackets around one item")
        kind = "" if opener + closer == "{}" else opener + closer
        return ("list", kind, tuple(items))

    def primary(self) -> tuple:
        token = self.peek()
        if token in _OPENERS:
            return self.group()
        if token is None or token in _UNREADABLE or not self.starts_operand(token):
            raise _Unreadable(f"unexpected {token!r}")
        self.take()
        if _is_number(token):
            return _number(token)
        if token[0] != "\\" or len(token) == 1:
            return ("sym", token)
        return self.command(token[1:])

    def command(self, name: str) -> tuple:
        if name == "frac" or name == "binom":
            first = self.peek()
            if _is_number(first) and len(first) == 2 and "." not in first:  # \frac12
                self.take()
                a, b = ("num", Fraction(first[0])), ("num", Fraction(first[1]))
            else:
                a, b = self.script(), self.script()
            return ("/", a, b) if name == "frac" else ("binom", a, b)
        if name == "sqrt":
            if self.peek() == "[":
                self.take()
                index = self.sum()
                self.expect("]")
                return ("root", index, self.script())
            return ("sqrt", self.script())
        if name in _FUNCTIONS:
            return self.function(name)
        args = []
        while self.peek() == "{":  # \overline{AB}, \vec{v}, \mathbf{v}: braces are arguments
            args.append(self.group())
        return ("cmd", name, tuple(args))

    def function(self, name: str) -> tuple:
        """``\\sin(x)``, ``\\log_2{8}``, ``\\sin^2(x)``; a bare argument (``\\sin 2x``) is unreadable."""
        sub = sup = None
        while self.peek() in ("^", "_"):
            kind = self.take()
            if kind == "^":
                sup = self.script()
            else:
                sub = self.script()
        if self.peek() not in ("(", "{"):
            raise _Unreadable(f"\\{name} without brackets around its argument")
        return ("fn", name, sub, sup, self.group())
