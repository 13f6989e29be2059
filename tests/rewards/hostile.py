"""Hostile completions for the rewards: each crashed, stalled or was scored wrongly by an earlier version.

``CRASHES_AND_STALLS`` maps an id to a completion (a 10-100 kB string where size matters). The rewards must
score every one as a float in bounded time. ``ALL_CONSTRAINTS`` is one valid constraint of every kind, so
a VerifyIf call over it runs every checker. Shared by ``test_hostile.py`` and ``benchmarks/bench_rewards.py``.
"""

from __future__ import annotations

KB = 1024

CRASHES_AND_STALLS = {
    # crashes: IndexError, OverflowError, ValueError (int-string limit), RecursionError
    "truncated-####": "Adding them up gives\n#### ",
    "truncated-####-tab": "so #### \t",
    "truncated-answer-is": "The answer is ",
    "float-overflow": "\\boxed{1e400}",
    "float-overflow-digits": "\\boxed{" + "9" * 400 + "}",
    "5000-digit-int": "\\boxed{" + "1" * 5000 + "}",
    "5000-digit-int-####": "#### " + "7" * 5000,
    "nested-slashes": "\\boxed{" + "1/" * 5000 + "1}",
    "nested-times-ten": "\\boxed{1" + " \\times 10^{2}" * 3000 + "}",
    "nested-frac": "\\boxed{" + "\\frac{1}{" * 3000 + "2" + "}" * 3000 + "}",
    "nested-sqrt": "\\boxed{" + "\\sqrt{" * 5000 + "2" + "}" * 5000 + "}",
    "nested-brackets": "\\boxed{" + "(" * 20000 + "1" + ")" * 20000 + "}",
    "json-nested-past-stack": "[" * 100_000,
    "json-5000-digit-number": "1" * 5000,
    # stalls: 10**exp for a huge exponent, super-linear regexes on long runs of one character
    "exponent-1e100000000": "\\boxed{1e100000000}",
    "times-ten-to-10^8": "\\boxed{2 \\times 10^{100000000}}",
    "tiny-exponent": "\\boxed{10^{-99999999}}",
    "power-tower": "\\boxed{9^{9^{9^{9^{9}}}}}",
    "slash-chain": "\\boxed{" + "1/" * 200 + "1}",
    "newlines-40k": "\n" * (40 * KB) + "x",
    "newlines-in-fence": "```\n" + "\n" * (20 * KB) + "x",
    "dots-40k": "." * (40 * KB) + "x",
    "spaces-40k": "answer is" + " " * (40 * KB) + "!",
    "spaces-after-marker": "#### 5" + " " * (40 * KB) + "x 1 2",
    "hashes-40k": "#" * (40 * KB),
    "answer-markers-100k": "answer: " * (12 * KB),
    "boxes-100k": "\\boxed{" * (14 * KB),
    "quotes-and-dashes": "a" + "'-" * (20 * KB) + " b",
    "stars-40k": "*" * (40 * KB),
    "bullets-and-blank-lines": "- \n\n" * (10 * KB),
    "section-lines": "Section \n" * (10 * KB),
    "harmony-final-stops": "<|channel|>final<|message|>" + "<|end|> " * (10 * KB),
    "mixed-100k": ("The answer is \\boxed{\\frac{1}{3}} #### 12 ... \n\n" * 2200)[: 100 * KB],
}

ALL_CONSTRAINTS = [
    {"type": "word_count", "min": 1, "max": 10_000},
    {"type": "sentence_count", "min": 1},
    {"type": "paragraph_count", "max": 5},
    {"type": "keywords_present", "keywords": ["answer", "sink token"]},
    {"type": "keywords_forbidden", "keywords": ["cat"]},
    {"type": "keyword_frequency", "keyword": "answer", "min": 2},
    {"type": "letter_frequency", "letter": "a", "max": 100},
    {"type": "json_format"},
    {"type": "markdown_headings", "min": 1},
    {"type": "bullet_count", "exactly": 3},
    {"type": "highlighted_sections", "min": 2},
    {"type": "placeholders", "min": 1},
    {"type": "all_lowercase"},
    {"type": "all_uppercase"},
    {"type": "capital_words", "max": 3},
    {"type": "starts_with", "phrase": "Dear"},
    {"type": "ends_with", "phrase": "Bye."},
    {"type": "no_commas"},
    {"type": "wrapped_in_quotes"},
    {"type": "title"},
    {"type": "postscript", "marker": "P.S."},
    {"type": "section_count", "splitter": "Section", "min": 2},
]
