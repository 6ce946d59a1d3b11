"""Clipping plugin-controlled text for a one-line summary never cuts a word in half and always says it was cut."""
from __future__ import annotations

from mha_harness.util.text import clipped


def test_a_text_that_fits_is_kept_whole():
    assert clipped("no decode step", 300) == "no decode step"


def test_a_long_text_is_cut_at_a_word_boundary_and_marked():
    why = ("declares inputs='self' (one x): decode runs the decode step of a layer that takes key/value inputs "
           "(inputs='separate', 'shared_kv' or 'kv_cache')")
    out = clipped(why, len(why) - 3)
    assert out.endswith(" ...") and len(out) <= len(why) - 3
    assert why.startswith(out[:-4]) and out[:-4].endswith("'shared_kv' or")  # not "'kv", a word cut in half


def test_a_long_text_without_spaces_is_cut_to_the_limit_and_marked():
    assert clipped("x" * 50, 20) == "x" * 16 + " ..."
