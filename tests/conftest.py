"""Shared pytest set-up: the package's own pytest plugin (the ``kvcanary_guard`` fixture) for every test, and a
clean compile cache per test module."""

import gc

import chex
import jax
import pytest

pytest_plugins = ["kvcanary_jax.testing.pytest_plugin"]


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_cache_per_module():
    """Frees each module's compiled executables when it ends.

    XLA:CPU maps every compiled kernel's code into the process (about three memory maps each) and keeps them while
    the executable is cached. A whole run compiles thousands, and past the kernel's ``vm.max_map_count`` (65530 by
    default) the next compile segfaults: the sglang-jax CI leg did, late in the run. chex's trace counters restart
    with the caches: a shared jitted step traces once more in the next module, and only that once.
    """
    yield
    jax.clear_caches()
    chex.clear_trace_counter()
    gc.collect()
