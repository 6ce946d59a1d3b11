"""An honest minimal plugin: malformed capabilities are refused, nothing is declared by accident, and what a
backend has not implemented is a skip with its reason, never an error."""
from __future__ import annotations

import pytest

import mha_harness
from mha_harness import AttentionBackend, AttentionOutput, Capabilities, LoadedAttention
from mha_harness.contract.reference import reference_attention


@pytest.mark.parametrize("fields, error, message", [
    ({"dtypes": ("float32", "float8")}, ValueError,
     "Capabilities.dtypes: got unknown 'float8'; accepted: a tuple of 'float64', 'float32', 'float16', 'bfloat16'"),
    ({"dtypes": "float32"}, TypeError, "Capabilities.dtypes: got 'float32'; accepted: a tuple of"),
    ({"dtypes": ()}, ValueError, "Capabilities.dtypes: got an empty tuple"),
    ({"dtypes": ("float32", "float32")}, ValueError, "Capabilities.dtypes: got duplicates"),
    ({"causal_alignments": "top-left"}, TypeError, "Capabilities.causal_alignments: got 'top-left'"),
    ({"causal_alignments": ("top_left",)}, ValueError,
     "Capabilities.causal_alignments: got unknown 'top_left'; accepted: a tuple of 'top-left', 'bottom-right'"),
    ({"gradients": "no"}, TypeError, "Capabilities.gradients: got 'no' of type str; accepted: True or False"),
    ({"key_padding_mask": 1}, TypeError, "Capabilities.key_padding_mask: got 1 of type int"),
    ({"devices": "cpu"}, TypeError, "Capabilities.devices: got 'cpu'"),
    ({"max_seq_len": 0}, ValueError, "Capabilities.max_seq_len: got 0; accepted: None or an integer >= 1"),
])
def test_malformed_capabilities_are_refused_naming_the_field(fields, error, message):
    """A string where a tuple belongs would declare by substring ('float' in 'float32'); a truthy 'no' would
    declare gradients: both are refused when the backend is defined."""
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        Capabilities(**fields)


def test_lists_are_accepted_and_stored_as_tuples():
    caps = Capabilities(dtypes=["float32"], causal_alignments=[])
    assert caps.dtypes == ("float32",) and caps.causal_alignments == () and not caps.has("causal")


def test_what_needs_code_beyond_compute_is_off_by_default():
    caps = Capabilities()
    assert not caps.has("gradients") and not caps.has("attention_weights")
    assert caps.has("key_padding_mask") and caps.has("causal:bottom-right") and caps.has("native_parameters")


class _Loaded(LoadedAttention):
    def __init__(self, params):
        self.params = params

    def compute(self, inputs, *, need_weights=False):
        return AttentionOutput(reference_attention(self.params, inputs).output)


class Minimal(AttentionBackend):
    """Only load_native and compute, default capabilities."""

    name = "minimal"

    def load_native(self, params, dtype):
        return _Loaded(params)


def test_a_minimal_plugin_gets_skips_with_reasons_never_errors():
    report = mha_harness.check(Minimal(), include_slow=False)
    statuses = {r.status for r in report.results}
    assert statuses <= {"passed", "skipped"}, [r.message for r in report.results if r.status not in statuses]
    skipped = {r.case: r.message for r in report.results if r.status == "skipped"}
    assert "implement native_parameter_shapes" in skipped["check_parameter_count_is_4_d_model_squared"]
    assert "attention_weights" in skipped["check_attention_weights_match_reference"]
    assert "gradients" in skipped["check_gradients_match_reference"]


def test_declaring_gradients_without_compute_vjp_is_refused_at_load():
    class ClaimsGradients(Minimal):
        name = "claims-gradients"
        capabilities = Capabilities(gradients=True)

    params = mha_harness.make_params(mha_harness.AttentionConfig(8, 2))
    with pytest.raises(TypeError, match="claims-gradients declares gradients=True but its _Loaded does not "
                                        "implement compute_vjp"):
        ClaimsGradients().load(params)


def test_a_loaded_object_whose_attribute_hides_vjp_is_refused_naming_it():
    """A stranger stored a jitted function as self.vjp; the harness's vjp was gone and JAX raised an opaque
    'Error interpreting argument ... AttentionInputs' from the proxy. Now load says what happened."""
    from mha_harness.contract.params import make_params
    from mha_harness.implementations.numpy_naive import NumpyNaive

    class Loaded(NumpyNaive.loaded_class):
        def __init__(self, params, dtype):
            super().__init__(params, dtype)
            self.vjp = lambda *args: None

    backend = NumpyNaive()
    backend.loaded_class = Loaded
    with pytest.raises(TypeError, match=r"Loaded\.vjp: an attribute of that name .* hides LoadedAttention\.vjp"):
        backend.load(make_params(mha_harness.AttentionConfig(8, 2)))
