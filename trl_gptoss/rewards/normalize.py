"""What a reader sees: the text VerifyIf checks, with invisible characters gone and look-alikes folded.

A policy must not pass a constraint by writing something that reads the same as what the constraint
forbids, or fail to count as what it plainly shows. So before any check the text is

- NFKC-normalised (full-width ``ｃａｔ`` is ``cat``, mathematical bold ``𝐇𝐄𝐋𝐋𝐎`` is ``HELLO``, ``﹐`` is ``,``,
  ``Ⓐ`` is ``A``), then
- stripped of format characters (Unicode category ``Cf``: zero-width space, soft hyphen, word joiner, BOM,
  bidi controls) and of the other default-ignorable characters that render as nothing (variation
  selectors, the combining grapheme joiner, Hangul fillers, Mongolian free variation selectors).

``fold_lookalikes`` further maps letters of other scripts that look like Latin ones (Cyrillic ``с``, ``а``,
Greek ``ο``, ...) to those Latin letters: a check that must not be fooled by a look-alike (a forbidden
keyword, an upper bound on a count) compares folded text; a check that must be earned (a keyword that must
appear) compares the text as written, so a look-alike never earns it either. Every step is linear.
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
_FOLD = str.maketrans(_LOOKALIKES)
# Characters that read as a comma: U+201A low quotation mark, the ideographic, Arabic, Armenian, NKo,
# Mongolian, Vai and Bamum commas, the raised and reversed commas, Lisu's comma-shaped tone letter.
COMMAS = ",\u201a\u3001\u060c\u055d\u07f8\u1802\u1808\ua60d\ua6f5\u2e34\u2e41\ua4f9"


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
