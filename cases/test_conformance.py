"""The conformance cases as pytest tests (collected through the mha-harness pytest plugin).

``pytest --pyargs mha_harness.cases --mha-backend NAME_OR_MODULE:OBJECT`` runs every case on that backend;
without ``--mha-backend`` every available registered backend is checked. ``--mha-search`` adds one property-based
search test per backend (``search_property_holds[NAME]``). The plugin collects the ``check_*`` functions of this
module only: the marker below says this is mha_harness's own cases module.
"""
from mha_harness.conformance.as_pytest import run_as_test, run_search_as_test
from mha_harness.conformance.casekit import all_cases

#: the marker the pytest plugin looks for (it acts on no other module)
MHA_HARNESS_CASES = True


def _make(case_name: str):
    def test(mha_backend, mha_params, request):
        target = getattr(request.config, "_mha_target_of", {}).get(mha_backend.name)
        spec = target.repro_spec if target else None
        run_as_test(case_name, mha_backend, mha_params, spec=spec)
    test.__name__ = case_name
    test.__doc__ = all_cases()[case_name].doc
    test._mha_case = case_name
    return test


for _name in all_cases():
    globals()[_name] = _make(_name)
del _name


def search_property_holds(mha_backend, request):
    """``--mha-search``: hypothesis finds no input on which the backend breaks the search property."""
    run_search_as_test(mha_backend, request.config)


search_property_holds._mha_search = True
