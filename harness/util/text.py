"""Shortening plugin-controlled text (skip reasons, error messages) for a one-line summary.

Property: a clipped text is the text itself when it fits; otherwise a prefix that ends at a word boundary, followed
by " ..." so a reader sees it was cut (never a word cut in half that reads like a typo, such as 'kv for 'kv_cache').
"""
from __future__ import annotations


def clipped(text, limit: int) -> str:
    """``text`` whole up to ``limit`` characters, else cut at the last space before it, with " ..." after."""
    text = str(text)
    if len(text) <= limit:
        return text
    head = text[:limit - 4]
    return (head.rsplit(" ", 1)[0] if " " in head else head) + " ..."
