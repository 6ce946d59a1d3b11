"""The JAX settings every built-in JAX backend uses, for a JAX plugin to share: float64 enabled and XLA's
persistent compilation cache.

    from mha_harness.toolkit.jax_setup import configure_jax   # also mha_harness.configure_jax
    configure_jax()          # once, before the plugin builds its first jax array

jax is imported only when the function is called. The cache lives in ``$MHA_HARNESS_JAX_CACHE`` (default
``~/.cache/mha-harness/jax``; set it to an empty string to disable), so a second conformance run skips most
compilation, and a plugin shares compiled programs with the built-in backends.
"""
from __future__ import annotations

import os
import warnings

from mha_harness.util.private_dir import private_dir

CACHE_ENV = "MHA_HARNESS_JAX_CACHE"
#: bound of the cache's size in MiB (``$MHA_HARNESS_JAX_CACHE_MAX_MB``); JAX evicts the least recently used entries
CACHE_MAX_ENV = "MHA_HARNESS_JAX_CACHE_MAX_MB"
DEFAULT_CACHE_MAX_MB = 1024
_CONFIGURED = False


def jax_cache_max_bytes() -> int:
    """The cache's size bound in bytes: ``$MHA_HARNESS_JAX_CACHE_MAX_MB`` (a positive integer) or 1024 MiB."""
    text = os.environ.get(CACHE_MAX_ENV, "")
    try:
        mib = int(text)
    except ValueError:
        mib = DEFAULT_CACHE_MAX_MB
    return (mib if mib > 0 else DEFAULT_CACHE_MAX_MB) * 2**20


def jax_cache_dir() -> str | None:
    """Where XLA's persistent compilation cache goes (None when disabled by an empty ``$MHA_HARNESS_JAX_CACHE``)."""
    cache = os.environ.get(CACHE_ENV, os.path.join(os.path.expanduser("~"), ".cache", "mha-harness", "jax"))
    return cache or None


def remove_orphaned_cache_entries(cache: str) -> list[str]:
    """Delete every compiled program in ``cache`` that has no ``-atime`` companion; returns their file names.

    JAX's bounded cache writes a program and then its access time as two files; a process killed in between
    (a worker at its timeout) leaves the program without the companion, possibly truncated, and from then on
    JAX's eviction sweep raises FileNotFoundError on every write, so the cache silently stops growing
    (jax-ml/jax#39880, fixed after jax 0.10). Done under the lock JAX itself takes around a write
    (``<cache>/.lockfile``); skipped when the lock cannot be had within 10 s."""
    import filelock
    try:
        with filelock.FileLock(os.path.join(cache, ".lockfile"), timeout=10):
            names = set(os.listdir(cache))
            orphans = sorted(n for n in names if n.endswith("-cache") and f"{n[:-len('-cache')]}-atime" not in names)
            for name in orphans:
                try:
                    os.unlink(os.path.join(cache, name))
                except FileNotFoundError:
                    pass
            return orphans
    except (filelock.Timeout, OSError):
        return []


def configure_jax() -> None:
    """Once per process: ``jax_enable_x64`` (float64 needs it; explicit dtypes keep float32 float32) and the
    persistent compilation cache with no minimum compile time or entry size, so every program is cached.

    The cache holds compiled code that later runs execute, so it must be private: the folder is created with
    mode 0700, and one that another user owns or can write is not used (a warning says why). Its size is
    bounded by ``jax_compilation_cache_max_size`` (:func:`jax_cache_max_bytes`; least recently used entries go)."""
    global _CONFIGURED
    if _CONFIGURED:
        return
    import jax
    jax.config.update("jax_enable_x64", True)
    cache, refused = private_dir(jax_cache_dir()) if jax_cache_dir() else (None, None)
    if refused:
        warnings.warn(f"mha-harness: JAX compile cache not used: {refused}", RuntimeWarning, stacklevel=2)
    if cache:
        remove_orphaned_cache_entries(cache)
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_compilation_cache_max_size", jax_cache_max_bytes())
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _CONFIGURED = True
