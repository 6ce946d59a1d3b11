"""Escaping text that plugins control (backend names, error messages) before it goes into a Markdown report.

Property: whatever a string holds, :func:`md_text` renders as that literal text on one line of a table
cell or list item. It cannot end the cell (``|``), open code, emphasis or a link, start a heading or a
new line (so it cannot forge a section such as "## Mutation score"), or inject raw HTML.
Underscores are left as they are, so identifiers such as ``check_scores_scaled`` stay greppable in the
file (GitHub Markdown keeps intraword underscores literal; at worst a word is shown in italics).
"""
from __future__ import annotations

import re

_SPECIAL = re.compile(r"([\\`*\[\]|])")


def md_text(value) -> str:
    """``value`` as literal one-line Markdown text: ``<`` and ``&`` HTML-escaped, Markdown punctuation
    backslash-escaped, line breaks turned into spaces, and a leading ``#``, ``>``, ``-``, ``+`` or ``=`` neutralised."""
    text = " ".join(str(value).splitlines()) if value is not None else ""
    # '<' and '&' are all raw HTML needs; a '>' alone opens nothing, and stays readable in the plain file
    # ("Tq = 64 > Tk = 1"), except at the start, where it would open a quote
    text = text.replace("&", "&amp;").replace("<", "&lt;")
    text = _SPECIAL.sub(r"\\\1", text)
    stripped = text.lstrip()
    if stripped[:1] in ("#", "-", "+", "=", ">"):
        text = "\\" + stripped
    return text


def md_code(value, *, in_table: bool = False) -> str:
    """``value`` as an inline code span on one line: the fence is longer than any run of backticks inside.

    Inside a code span Markdown interprets nothing, so no further escaping is needed, except ``|`` in a
    table cell (GitHub's tables split on it even there)."""
    text = " ".join(str(value).splitlines())
    if in_table:
        text = text.replace("|", "\\|")
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or longest else ""
    return f"{fence}{pad}{text}{pad}{fence}"
