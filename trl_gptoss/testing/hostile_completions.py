"""Hostile completions for the rewards: each crashed, stalled or was scored wrongly by an earlier version.

``CRASHES_AND_STALLS`` maps an id to a completion (a 10-100 kB string where size matters). The rewards must
score every one as a float in bounded time. ``FALSE_POSITIVES`` maps an id to ``(completion, truth)``: a
completion that does NOT state the truth (grouping, case, precision, negation, text after the final
message, guesses in several boxes); ``retool_reward`` must give -1 and ``gsm8k_reward`` 0.
``ALL_CONSTRAINTS`` is one valid constraint of every kind, so a VerifyIf call over it runs every checker.
Shared by ``tests/rewards/test_hostile.py`` and ``benchmarks/bench_rewards.py``.
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
    # the structural parser: nesting within MAX_ANSWER_CHARS, runs of signs, scripts, boxes in boxes
    "parens-199-deep": "\\boxed{" + "(" * 199 + "x" + ")" * 199 + "}",
    "braces-199-deep": "\\boxed{" + "{" * 199 + "1" + "}" * 199 + "}",
    "frac-tower-in-box": "\\boxed{" + "\\frac{1}{" * 40 + "2" + "}" * 40 + "}",
    "power-tower-in-box": "\\boxed{" + "x^{" * 120 + "2" + "}" * 120 + "}",
    "signs-399": "\\boxed{" + "-" * 398 + "x}",
    "boxes-in-boxes": "\\boxed{" * 50 + "1" + "}" * 50,
    "same-box-20k": "\\boxed{1}" * (2 * KB),
    "distinct-boxes-10k": "".join(f"\\boxed{{{i}}}" for i in range(10 * KB)),
    "markers-####-10k": "#### 1\n" * (10 * KB),
    "final-headers-10k": "<|channel|>final<|message|>" * (4 * KB) + "\\boxed{1}",
    "lone-surrogates": "\\boxed{\ud800\udfff} \ud83d #### \udc00",
    "digits-399-symbolic": "\\boxed{" + "9" * 390 + "\\pi}",
    "unicode-digits": "\\boxed{\u00b2\u0663\u2076} #### \u0663",
}

FALSE_POSITIVES = {
    # grouping and case are lost when answers compare as stripped text
    "implicit-product-vs-sum": ("\\boxed{2x+1}", "2(x+1)"),
    "sqrt-of-fraction": ("\\boxed{\\sqrt{3/2}}", "\\sqrt{3}/2"),
    "sqrt-then-digit": ("\\boxed{\\sqrt{2}3}", "\\sqrt{23}"),
    "denominator-grouping": ("\\boxed{a/b+c}", "\\frac{a}{b+c}"),
    "exponent-grouping": ("\\boxed{e^x+1}", "e^{x+1}"),
    "negated-square": ("\\boxed{(-x)^2}", "-x^2"),
    "ambiguous-slash": ("\\boxed{1/2x}", "\\frac{1}{2x}"),
    "latex-script-digit": ("\\boxed{x^23}", "x^{23}"),
    "spaced-digits": ("\\boxed{1 2\\pi}", "12\\pi"),
    "capital-Pi": ("\\boxed{\\Pi}", "\\pi"),
    "capital-variable": ("\\boxed{X}", "x"),
    # a product is not a digit string
    "product-2(3)": ("\\boxed{2(3)}", "23"),
    "product-(2)(3)": ("\\boxed{(2)(3)}", "23"),
    "mixed-number": ("\\boxed{1\\frac{1}{2}}", "11/2"),
    "fraction-then-digit": ("\\boxed{\\frac{1}{2}3}", "1/23"),
    # a tolerance wider than the written precision
    "relative-tolerance": ("\\boxed{333333.5}", "1000001/3"),
    "too-few-digits": ("\\boxed{66.667}", "200/3"),
    "integer-for-fraction": ("\\boxed{333333333}", "1000000000/3"),
    # a negation, a conjunction or a variable is not a unit
    "negation-after": ("\\boxed{1170 not}", "1170"),
    "negation-before": ("\\boxed{not 1170}", "1170"),
    "wrong-after": ("\\boxed{1170 wrong}", "1170"),
    "or-after": ("\\boxed{1170 or}", "1170"),
    "variable-after": ("\\boxed{5x}", "5"),
    "euler-after": ("\\boxed{5e}", "5"),
    # numbers
    "decimal-point-vs-thousands": ("\\boxed{1.000}", "1000"),
    "percent-of-percent": ("\\boxed{5\\%}", "0.0005"),
    # only the final message is scored
    "after-final-end": ("<|channel|>final<|message|>\\boxed{1}<|end|>\\boxed{2}", "2"),
    "after-final-return": ("<|channel|>final<|message|>#### 1<|return|>#### 2", "2"),
    "analysis-only": ("<|channel|>analysis<|message|>\\boxed{2}<|end|>", "2"),
    "after-prefilled-final": ("\\boxed{1}<|return|>\\boxed{2}", "2"),
    # boxes: the outer box is the answer, and every box must state it
    "box-in-box": ("\\boxed{3 + \\boxed{2}}", "2"),
    "two-boxes": ("\\boxed{3} or \\boxed{2}", "2"),
    "box-list": ("".join(f"\\boxed{{{i}}}" for i in range(10)), "9"),
    "unclosed-outer-box": ("\\boxed{3 \\boxed{2}", "2"),
    "two-markers": ("#### 3\n#### 2", "2"),
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
