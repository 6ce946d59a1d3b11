"""The public mask builder, so that ``import mha_harness.masks`` and ``from mha_harness.masks import causal_mask``
work as ``mha_harness.masks`` does after ``import mha_harness``: this module *is*
:mod:`mha_harness.toolkit.masks` (the same module object, whichever way it is reached)."""
import sys

import mha_harness

mha_harness.load_core()  # the integrity snapshot is taken before any plugin imports the masks, as on attribute use

from mha_harness.toolkit import masks as _masks  # noqa: E402 - after the core, as the attribute does

sys.modules[__name__] = _masks
