"""The public toolkit for plugin authors: mask builder, JAX settings helper, and the documented case catalogue."""
from __future__ import annotations

import numpy as np
import pytest

import mha_harness
from mha_harness import masks
from mha_harness.contract.reference import allowed_and_bias
from tests.conftest import ROOT


def test_causal_mask_in_both_alignments_and_polarities():
    assert masks.causal_mask(2, 4).tolist() == [[True, False, False, False], [True, True, False, False]]
    assert masks.causal_mask(2, 4, "bottom-right").tolist() == [[True, True, True, False], [True, True, True, True]]
    assert (masks.causal_mask(3, 3, polarity="ignore") == ~np.tril(np.ones((3, 3), bool))).all()
    with pytest.raises(ValueError, match="alignment: got 'diagonal'"):
        masks.causal_mask(2, 2, "diagonal")
    with pytest.raises(ValueError, match="polarity: got 'keep'"):
        masks.causal_mask(2, 2, polarity="keep")


def test_the_mask_builder_is_one_module_however_it_is_imported():
    """``import mha_harness.masks``, ``from mha_harness.masks import ...`` and the attribute after ``import
    mha_harness`` give the same module, in a fresh interpreter, in either order."""
    import subprocess
    import sys
    orders = [
        "import mha_harness.masks as m; import mha_harness; from mha_harness.masks import causal_mask; "
        "import mha_harness.toolkit.masks as t; "
        "assert m is t and mha_harness.masks is t and causal_mask is t.causal_mask",
        "import mha_harness; a = mha_harness.masks; import mha_harness.masks as m; assert a is m; "
        "assert m.causal_mask(1, 2).tolist() == [[True, False]]",
    ]
    for code in orders:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, done.stderr


def test_padding_mask_marks_padding_by_default():
    assert masks.padding_mask([3, 1], 3).tolist() == [[False, False, False], [False, True, True]]
    assert masks.padding_mask([3, 1], 3, polarity="attend").tolist() == [[True, True, True], [True, False, False]]
    with pytest.raises(ValueError, match="lengths"):
        masks.padding_mask([4], 3)


def test_combined_and_additive_masks_agree_with_the_reference():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 8))
    bias = np.where(rng.random((4, 6)) < 0.7, rng.standard_normal((4, 6)), -np.inf)
    inputs = mha_harness.AttentionInputs(x, rng.standard_normal((2, 6, 8)), rng.standard_normal((2, 6, 8)),
                                         causal="bottom-right", key_padding_mask=masks.padding_mask([6, 4], 6),
                                         attn_mask=bias)
    params = mha_harness.make_params(mha_harness.AttentionConfig(8, 2))
    allowed, additive = allowed_and_bias(params, inputs)
    assert (masks.combined_mask(inputs) == allowed).all()
    assert (masks.combined_mask(inputs, polarity="ignore") == ~allowed).all()
    add = masks.additive_mask(inputs)
    assert np.array_equal(np.isneginf(add), ~np.broadcast_to(allowed, add.shape))
    assert np.allclose(np.where(np.isfinite(add), add, 0), np.where(allowed, additive, 0))
    assert masks.additive_mask(inputs, masked_value=-1e9).min() == -1e9
    assert masks.combined_mask(inputs.replace(causal=None, key_padding_mask=None, attn_mask=None)) is None


def test_jax_helper_is_the_one_the_builtin_jax_backends_use():
    from mha_harness.implementations import _jax_common
    from mha_harness.toolkit import jax_setup
    assert _jax_common.configure_jax is jax_setup.configure_jax is mha_harness.configure_jax


def test_jax_cache_dir_follows_the_environment(monkeypatch):
    from mha_harness.toolkit.jax_setup import jax_cache_dir
    monkeypatch.setenv("MHA_HARNESS_JAX_CACHE", "")
    assert jax_cache_dir() is None
    monkeypatch.setenv("MHA_HARNESS_JAX_CACHE", "/tmp/x")
    assert jax_cache_dir() == "/tmp/x"


def test_docs_case_parameter_table_is_the_generated_one():
    from mha_harness.cases._catalogue import markdown_table
    page = (ROOT / "docs" / "cases.md").read_text()
    assert markdown_table() in page, "regenerate with: python -m mha_harness.cases._catalogue"


def test_named_variants_replace_shape_numbers_in_builtin_divergences():
    from mha_harness.cases._catalogue import case_parameters
    catalogue = case_parameters()
    from mha_harness.implementations.jax_dpa import DIVERGENCES
    from mha_harness.toolkit.divergences import uniform_fully_masked_divergences
    for d in uniform_fully_masked_divergences("r") + DIVERGENCES:
        assert not {"seq", "tk"} & set(d.when), d
        named = d.when.get("variant")
        if named is not None:
            names = named if isinstance(named, (list, tuple)) else [named]
            assert set(names) <= set(catalogue[d.case]["variants"]), d


def _own_causal_flag_layer(mask_with_causal: bool):
    """A self-form layer that masks causally through its own flag, with the classic bug (triu where tril belongs),
    building its padding mask with combined_mask, the causal mask included or left out."""
    class Loaded(mha_harness.LoadedAttention):
        def __init__(self, params):
            self.p = params

        def compute(self, inputs, *, need_weights=False):
            p, x = self.p, inputs.query
            b, t, d = x.shape
            h = p.config.num_heads
            split = lambda m: m.reshape(b, t, h, d // h).transpose(0, 2, 1, 3)  # noqa: E731
            q, k, v = split(x @ p.W_q), split(x @ p.W_k), split(x @ p.W_v)
            scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // h)
            if inputs.causal:  # the layer's own causal flag: the bug
                scores = np.where(np.triu(np.ones((t, t), bool)), scores, -np.inf)
            allowed = masks.combined_mask(inputs, causal=mask_with_causal)
            if allowed is not None:
                scores = np.where(allowed, scores, -np.inf)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            w = np.nan_to_num(w / w.sum(-1, keepdims=True))
            return mha_harness.AttentionOutput((w @ v).transpose(0, 2, 1, 3).reshape(b, t, d) @ p.W_o)

    class Layer(mha_harness.AttentionBackend):
        name = "own-causal-flag"
        capabilities = mha_harness.Capabilities(inputs="self", causal_alignments=("top-left",), key_padding_mask=True,
                                                bias=False, dtypes=("float64",))

        def load_native(self, params, dtype):
            return Loaded(params)
    return Layer()


def test_combined_mask_can_leave_the_causal_mask_out_for_a_layer_with_its_own_causal_flag():
    """A stranger's Flax layer took ``causal=True`` and ``combined_mask(inputs)`` (which includes the causal mask):
    the harness's mask then hid a reversed causal mask in the layer's own path, and the leak case passed.
    ``combined_mask(inputs, causal=False)`` leaves it out, and the same bug is caught and named."""
    leak = "check_causal_mask_blocks_future_keys"
    hidden = mha_harness.check(_own_causal_flag_layer(mask_with_causal=True), cases=[leak])
    assert hidden.ok  # what the README now warns about: the harness's causal mask did the masking
    caught = mha_harness.check(_own_causal_flag_layer(mask_with_causal=False),
                               cases=[leak, "check_causal_output_matches_reference"])
    failed = [r for r in caught.results if r.status == "failed"]
    assert {r.case for r in failed} == {leak, "check_causal_output_matches_reference"}
    assert any("reversed causal mask" in r.message for r in failed), [r.message for r in failed]
    inputs = mha_harness.AttentionInputs(*(np.zeros((1, 3, 4)),) * 3, causal="top-left",
                                         key_padding_mask=masks.padding_mask([2], 3))
    assert masks.combined_mask(inputs, causal=False).tolist() == [[[[True, True, False]] * 3]]
    assert masks.additive_mask(inputs, causal=False)[0, 0, 0].tolist() == [0.0, 0.0, -np.inf]
    assert masks.combined_mask(inputs.replace(key_padding_mask=None), causal=False) is None
    with pytest.raises(TypeError, match="causal: got 'no'; accepted: True"):
        masks.combined_mask(inputs, causal="no")
