"""What a reader sees: the text VerifyIf checks, with invisible characters gone and look-alikes folded.

A policy must not pass a constraint by writing something that reads the same as what the constraint
forbids, or fail to count as what it plainly shows. So before any check the text is

- NFKC-normalised (full-width ``ｃａｔ`` is ``cat``, mathematical bold ``𝐇𝐄𝐋𝐋𝐎`` is ``HELLO``, ``﹐`` is ``,``,
  ``Ⓐ`` is ``A``), then
- stripped of format characters (Unicode category ``Cf``: zero-width space, soft hyphen, word joiner, BOM,
  bidi controls) and of the other default-ignorable characters that render as nothing (variation
  selectors, the combining grapheme joiner, Hangul fillers, Mongolian free variation selectors).

``fold_lookalikes`` further maps letters that look like Latin ones (Cyrillic ``с``, ``а``, Greek ``ο``, the
Latin small capitals ``ᴄ``, ``ɪ``, the dotless ``ı``, ...) to those Latin letters: a check that must not be
fooled by a look-alike (a forbidden keyword, an upper bound on a count) compares folded text; a check that must
be earned (a keyword that must appear) compares the text as written, so a look-alike never earns it either.
Every step is linear.
"""

from __future__ import annotations

import re
import unicodedata

_IGNORABLE = re.compile("[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u3164\ufe00-\ufe0f\uffa0\U000e0100-\U000e01ef]")
# Cyrillic and Greek letters that read as Latin ones (Unicode's confusables for these scripts, letters only).
_LOOKALIKES = {
    **dict(zip("аеорсухіјѕԁһӏԛԝүɡ", "aeopcyxijsdhlqwyg")),
    **dict(zip("АВЕКМНОРСТХУІЈЅԚԜҮ", "ABEKMHOPCTXYIJSQWY")),
    **dict(zip("αοριντκυχ", "aopivtkux")),
    **dict(zip("ΑΒΕΖΗΙΚΜΝΟΡΤΥΧ", "ABEZHIKMNOPTYX")),
}
# Latin small capitals (``ᴄ`` U+1D04, ``ɪ``, ``ꜱ``, ...) read as their letter; NFKC leaves them as they are, and
# folds the modifier letters (``ᶜ``, ``ᴬ``; ``ᶦ`` to ``ɪ``) to a letter or one of these. Found by name, so every
# one this Python's Unicode database knows is folded; the dotless ``ı`` and ``ȷ`` read as ``i`` and ``j``.
_SMALL_CAPITAL = re.compile(r"LATIN LETTER SMALL CAPITAL ([A-Z])")
_SMALL_CAPITALS = {
    ch: match.group(1).lower()
    for ch in map(chr, [*range(0x0250, 0x02B0), *range(0x1D00, 0x1D2C), *range(0xA720, 0xA800)])
    if (match := _SMALL_CAPITAL.fullmatch(unicodedata.name(ch, "")))
}
_FOLD = str.maketrans({**_LOOKALIKES, **_SMALL_CAPITALS, "\u0131": "i", "\u0237": "j"})
# Characters that read as a comma: U+201A low quotation mark, the ideographic, Arabic, Armenian, NKo,
# Mongolian, Vai and Bamum commas, the raised, reversed and turned commas, Lisu's comma-shaped tone letter, the
# low acute and low grave modifier letters (``ˏ``, ``ˎ``) and the combining comma below (on a digit: ``5̦``).
COMMAS = ",\u201a\u3001\u060c\u055d\u07f8\u1802\u1808\ua60d\ua6f5\u2e34\u2e41\ua4f9\u2e32\u02cf\u02ce\u0326"


def visible_text(text: str) -> str:
    """NFKC, then without format (``Cf``) and other default-ignorable characters."""
    text = unicodedata.normalize("NFKC", text)
    if text.isascii():
        return text
    text = "".join(ch for ch in text if unicodedata.category(ch) != "Cf")
    return _IGNORABLE.sub("", text)


def fold_lookalikes(text: str) -> str:
    """``text`` with Cyrillic/Greek letters that look Latin replaced by those Latin letters."""
    return text if text.isascii() else text.translate(_FOLD)
