"""The JAX compile cache holds compiled code: its folder is private (0700), a folder others can write is
refused, and its size is bounded."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from mha_harness.util.private_dir import private_dir
from tests.conftest import ROOT


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_cache_folder_is_created_private(tmp_path):
    path, why = private_dir(str(tmp_path / "a" / "jax"))
    assert why is None and _mode(path) == 0o700


def test_a_readable_folder_of_this_user_is_made_private(tmp_path):
    folder = tmp_path / "jax"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    path, why = private_dir(str(folder))
    assert why is None and _mode(path) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_folder_others_can_write_is_refused_with_the_reason(tmp_path, mode):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(mode)
    path, why = private_dir(str(folder))
    assert path is None and "can be written by other users" in why and "chmod 700" in why


def test_a_link_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    path, why = private_dir(str(tmp_path / "link"))
    assert path is None and "not a folder" in why


_PROBE = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from mha_harness.toolkit.jax_setup import configure_jax
    configure_jax()
import jax
print(json.dumps({"dir": jax.config.jax_compilation_cache_dir, "max": jax.config.jax_compilation_cache_max_size,
                  "warnings": [str(w.message) for w in caught]}))
"""


def _configure(env):
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_configure_jax_bounds_the_cache_and_keeps_it_private(tmp_path):
    pytest.importorskip("jax")
    cache = tmp_path / "cache"
    got = _configure({"MHA_HARNESS_JAX_CACHE": str(cache), "MHA_HARNESS_JAX_CACHE_MAX_MB": "7"})
    assert got["dir"] == str(cache) and got["max"] == 7 * 2**20 and _mode(cache) == 0o700


def test_configure_jax_refuses_a_world_writable_cache(tmp_path):
    pytest.importorskip("jax")
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o777)
    got = _configure({"MHA_HARNESS_JAX_CACHE": str(cache)})
    assert not got["dir"] and any("can be written by other users" in w for w in got["warnings"])


_COMPILE_ONE = """
import os, warnings
warnings.simplefilter("error")   # JAX reports a failed cache write as a warning
from mha_harness.toolkit.jax_setup import configure_jax
configure_jax()
import jax, jax.numpy as jnp
jax.jit(lambda x: x * 3 + 1)(jnp.ones(5)).block_until_ready()
print(sorted(os.listdir(os.environ["MHA_HARNESS_JAX_CACHE"])))
"""


def test_an_orphaned_cache_entry_is_removed_so_the_cache_keeps_growing(tmp_path):
    """A program file without its -atime companion (a process killed between JAX's two writes) would make JAX's
    eviction sweep fail every later write (jax-ml/jax#39880); configure_jax removes it first."""
    pytest.importorskip("jax")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (cache / "jit_orphan-0123-cache").write_bytes(b"truncated")
    out = subprocess.run([sys.executable, "-c", _COMPILE_ONE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MHA_HARNESS_JAX_CACHE": str(cache)})
    assert out.returncode == 0, out.stderr
    names = os.listdir(cache)
    assert "jit_orphan-0123-cache" not in names
    written = [n for n in names if n.endswith("-cache")]
    assert written and all(f"{n[:-len('-cache')]}-atime" in names for n in written), names
