"""Replaying what ``mha-harness search`` found: every saved minimal failing example must pass from then on."""
from __future__ import annotations

from mha_harness.conformance.casekit import CaseSkipped, FormSkipped, Measurement, case
from mha_harness.conformance.search_examples import check_example, load_regression, saved_regressions, search_dir

NONE_SAVED = "none"


def _regression_variants(backend) -> list[dict]:
    """One variant per regression file saved for this backend (``results/search/<backend>/<id>.json``)."""
    return [{"regression": p.stem} for p in saved_regressions(backend.name)] or [{"regression": NONE_SAVED}]


@case(variants=_regression_variants, forms=("separate", "shared_kv", "self", "kv_cache"))
def check_search_regressions_still_pass(backend, *, regression):
    """Each minimal example that ``mha-harness search`` once shrank a failure of this backend to (saved under
    results/search/<backend>/, or $MHA_HARNESS_SEARCH_DIR) now satisfies the search property: output equal to the
    float64 reference under the tolerance rule, masked keys/values (even NaN) leave unmasked rows unchanged,
    gradients, bad input and parameter count as the cases state them. Each example replays in the input form it was
    found in, so the case runs for every form."""
    folder = search_dir() / backend.name
    if regression == NONE_SAVED:
        raise CaseSkipped(f"no search regression saved for {backend.name} under {folder}/ "
                          "(mha-harness search saves one when it finds a failure)")
    data = load_regression(folder / f"{regression}.json")
    form = data["example"].get("form", "separate")
    if not backend.capabilities.accepts_form(form):
        raise FormSkipped(f"the saved example {regression} is in the {form!r} input form, which "
                          f"Capabilities.inputs={backend.capabilities.inputs!r} does not accept")
    return Measurement(max_error=check_example(backend, data["example"]),
                       observed=f"found {data.get('message', '')[:80]!r} before; passes now")
