"""Shared fixtures for the harness's own tests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, cwd=ROOT, timeout=600, env=None):
    """Run ``python -m mha_harness ARGS`` in a subprocess; returns CompletedProcess with text output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "mha_harness", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True,
                          timeout=timeout, env=full_env)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def numpy_backends():
    from mha_harness.implementations.numpy_naive import NumpyNaive
    from mha_harness.implementations.numpy_tiled import NumpyTiled
    return [NumpyNaive(), NumpyTiled()]
