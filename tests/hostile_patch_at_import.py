"""A plugin module that replaces np.exp when it is imported (in every process that imports it)."""
import numpy as np

from mha_harness.implementations.numpy_naive import NumpyNaive

_exp = np.exp
np.exp = lambda x, *args, **kwargs: _exp(x, *args, **kwargs)


class Backend(NumpyNaive):
    name = "hostile-patch-at-import"
