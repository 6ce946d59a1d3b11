"""Shared fixtures for the harness's own tests."""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


#: a directory holding only a link to tests/, so worker processes (which inherit this sys.path) can import tests.*
_TESTS_ONLY = Path(tempfile.mkdtemp(prefix="mha-harness-tests-path-"))
(_TESTS_ONLY / "tests").symlink_to(ROOT / "tests")
atexit.register(shutil.rmtree, _TESTS_ONLY, ignore_errors=True)


def _forget_the_source_tree() -> None:
    """Test the INSTALLED namespace: take the repository root off sys.path (``python -m pytest`` and pytest's rootdir
    insertion put it there), so a stray top-level ``import cases`` / ``import harness`` fails here as it does for a
    user; ``tests.*`` stays importable (the tests' own plugin objects) through a directory that holds only tests/."""
    sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != ROOT]
    if str(_TESTS_ONLY) not in sys.path:
        sys.path.append(str(_TESTS_ONLY))


_forget_the_source_tree()

# The core, loaded once for the session (the pytest plugin no longer loads it): pytester's in-process runs drop the
# modules first imported inside them, and a second copy of the harness would look like tampering to the tripwire.
import mha_harness.checking  # noqa: E402, F401


def pytest_runtest_setup(item):
    _forget_the_source_tree()  # pytest puts the root back while it imports test modules


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
