"""The shared conformance cases. Importing this package registers every ``check_*`` function.

Each case is a plain function over any backend (see :mod:`mha_harness.casekit`). Cases talk to
backends only through the plugin API and never import torch or jax. Run them with
``mha-harness check``, ``mha_harness.check(backend)`` or ``pytest --pyargs mha_harness.cases``.
"""
from mha_harness.cases import (  # noqa: F401
    agreement,
    alibi,
    bad_input,
    decode_step,
    gradients,
    invariance,
    masks,
    projections,
    search_regressions,
    sliding_window,
)
