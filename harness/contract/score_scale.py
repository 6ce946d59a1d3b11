"""The score scale a layer applies to Q K^T: the standard 1/sqrt(d_head), or one the layer declares by design.

A declaration is ``None`` (the standard 1/sqrt(d_head)), a rule that depends on the head width (``"1/sqrt(d_head)"``,
``"1/d_head"``: muP's attention), or a finite number > 0 applied at every head width (``1.0``: T5, which folds the
scale into its query weights; ``query_pre_attn_scalar ** -0.5``: Gemma's). The reference, the cases' wrong-scale
diagnoses and bench's output check all take the scale from here.
"""
from __future__ import annotations

import math

#: the scale rules that depend on the head width, by their name
SCALE_RULES = {"1/sqrt(d_head)": lambda d_head: 1.0 / math.sqrt(d_head), "1/d_head": lambda d_head: 1.0 / d_head}

#: the accepted declarations, in words (for error messages)
ACCEPTED = ("None (the standard 1/sqrt(d_head)), " + " or ".join(map(repr, SCALE_RULES))
            + " (a rule of the head width; '1/d_head' is muP's), or a finite number > 0 applied at every head width "
            "(1.0 for T5's unscaled scores; Gemma's query_pre_attn_scalar ** -0.5)")


def checked_score_scale(value, where: str = "score_scale"):
    """``value`` as a declaration (a rule's name, a float, or None for the standard rule); a ValueError naming
    ``where`` and the accepted values otherwise (a bool, a string that names no rule, zero, a negative or
    non-finite number)."""
    if value is None or (isinstance(value, str) and value in SCALE_RULES):
        return None if value == "1/sqrt(d_head)" else value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise ValueError(f"{where}: got {value!r}; accepted: {ACCEPTED}")


def score_scale_at(declared, d_head: int) -> float:
    """The scale a layer of ``d_head``-wide heads multiplies its scores by under the declaration ``declared``."""
    if declared is None:
        return SCALE_RULES["1/sqrt(d_head)"](d_head)
    return SCALE_RULES[declared](d_head) if isinstance(declared, str) else float(declared)


def score_scale_label(declared) -> str:
    """The declaration in words: "1/sqrt(d_head)", "1/d_head", "1 (no scaling)" or the number ("0.0625")."""
    if declared is None:
        return "1/sqrt(d_head)"
    if isinstance(declared, str):
        return declared
    return "1 (no scaling)" if declared == 1.0 else f"{declared:g}"
