"""Plugins that attack the parent process while they are imported, constructed or asked availability().

Each attribute is a ``module:object`` target for the guarded-loading tests (tests/test_guarded_loading.py).
Importing this module itself is harmless; the import-time attacks live in tests/hostile_import_*.py.
"""
from __future__ import annotations

import sys
import time

from mha_harness.implementations.numpy_naive import NumpyNaive


class ExitsInAvailability(NumpyNaive):
    name = "hostile-exit-in-availability"

    def availability(self):
        sys.exit(0)


class InterruptsInAvailability(NumpyNaive):
    name = "hostile-interrupt-in-availability"

    def availability(self):
        raise KeyboardInterrupt


class HangsInAvailability(NumpyNaive):
    name = "hostile-hang-in-availability"

    def availability(self):
        time.sleep(3600)


class ExitsInConstructor(NumpyNaive):
    name = "hostile-exit-in-constructor"

    def __init__(self):
        sys.exit(0)


def interrupts_in_factory():
    raise KeyboardInterrupt


class FineNaive(NumpyNaive):
    name = "fine-naive"
