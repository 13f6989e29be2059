"""VerifyIf: instruction-following reward from verifiable constraints (per-constraint and overall scores).

Each row carries ``constraints``: a list of ``{"type": KIND, **params}`` dicts (see ``constraints.py``),
or the same list as JSON text (what ``trl_gptoss.data`` stores, since Arrow columns need one schema).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from trl_gptoss.rewards.answers import completion_text
from trl_gptoss.rewards.constraints import CHECKERS, validate_constraint


@dataclass(frozen=True)
class ConstraintScores:
    """``per_constraint``: ``[(type, passed), ...]`` in order; ``score``: fraction passed (1.0 when there
    are none); ``all_passed``: every constraint holds (IFEval's "strict" prompt-level accuracy)."""

    per_constraint: list[tuple[str, bool]]
    score: float
    all_passed: bool


def parse_constraints(constraints) -> list[dict]:
    """A validated list of constraint dicts from a list, or from its JSON text.

    Raises ``ValueError`` naming the entry (``constraints[1]: ...``) when one is malformed; this depends on
    the dataset only, never on a completion, and the data loaders already raise it at load time.
    """
    if isinstance(constraints, str):
        try:
            constraints = json.loads(constraints)
        except ValueError as exc:
            raise ValueError(f"constraints is not valid JSON ({exc}); store a JSON list of dicts.") from exc
    if not isinstance(constraints, list):
        raise ValueError(f"constraints must be a list of {{'type': ...}} dicts, got {type(constraints).__name__}.")
    for i, constraint in enumerate(constraints):
        try:
            validate_constraint(constraint)
        except ValueError as exc:
            raise ValueError(
                f"constraints[{i}]: {exc} Datasets loaded with trl_gptoss.data are checked at load time; "
                "check others with trl_gptoss.rewards.validate_constraint before training."
            ) from None
    return constraints


def score_constraints(text: str, constraints) -> ConstraintScores:
    """Check every constraint on ``text``; the score is the fraction that pass. Linear in ``len(text)``."""
    parsed = parse_constraints(constraints)
    per = [(c["type"], bool(CHECKERS[c["type"]](text, **_params(c)))) for c in parsed]
    passed = sum(ok for _, ok in per)
    return ConstraintScores(per, passed / len(per) if per else 1.0, passed == len(per))


def _params(constraint: dict) -> dict:
    return {k: v for k, v in constraint.items() if k != "type"}


def _rewards(completions, constraints, strict: bool, log_extra=None) -> list[float | None]:
    if constraints is None:
        raise ValueError("verifyif_reward needs a 'constraints' dataset column.")
    if len(constraints) != len(completions):
        raise ValueError(f"verifyif_reward: {len(completions)} completions but {len(constraints)} constraint lists.")
    scores = [None if c is None else score_constraints(completion_text(p), c) for p, c in zip(completions, constraints)]
    if log_extra is not None:  # TRL's completions table gets the per-constraint verdicts
        log_extra("constraints_passed", [None if s is None else json.dumps(s.per_constraint) for s in scores])
    if strict:
        return [None if s is None else float(s.all_passed) for s in scores]
    return [None if s is None else s.score for s in scores]


def verifyif_reward(completions, constraints=None, log_extra=None, **kwargs) -> list[float | None]:
    """Fraction of the row's constraints the completion satisfies, in ``[0, 1]`` (TRL signature)."""
    return _rewards(completions, constraints, strict=False, log_extra=log_extra)


def verifyif_strict_reward(completions, constraints=None, log_extra=None, **kwargs) -> list[float | None]:
    """``1.0`` only when every constraint holds, else ``0.0`` (TRL signature)."""
    return _rewards(completions, constraints, strict=True, log_extra=log_extra)
