"""Shared pytest set-up: the package's own pytest plugin (the ``kvcanary_guard`` fixture) for every test, jax's
persistent compilation cache for the run, XLA's quickest compile (backend optimisation off), the longest modules
first, and compiled executables freed before the process runs out of memory maps.
"""

import gc
import os
import shutil
import tempfile

import chex
import jax
import pytest

pytest_plugins = ["kvcanary_jax.testing.pytest_plugin"]

_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_IN_RUN_ENV = "KVCANARY_TEST_RUN"  # set in a run's processes, so a pytest that a test starts knows it is nested
_MAX_WORKERS = 4  # each worker holds its own compiled steps (2-3 GB late in a run)
# Past this share of ``vm.max_map_count``, or this many resident bytes, a module's end frees every compiled executable.
_MAX_MAP_SHARE = 0.5
_MAX_RESIDENT = 4 << 30
# The modules that take longest, longest first (measured: the sglang-jax leg's `--junitxml` times, summed per module;
# parallel and HiCache, newer, beside the engine's). They start first, so that the short modules fill both workers at
# the end; in xdist's default order (most tests first) the one-test subprocess modules came last, and a worker ran one
# alone for minutes while the other had nothing left.
_LONG_MODULES = (
    "tests/pallas_kernels/test_phase_kernel.py",
    "tests/integrations/test_sglang_jax_engine.py",
    "tests/integrations/test_sglang_jax_parallel.py",
    "tests/integrations/test_sglang_hicache.py",
    "tests/integrations/test_sglang_jax_serve.py",
    "tests/integrations/test_sglang_jax_serve_swa.py",
    "tests/integrations/test_sglang_jax_swa.py",
    "tests/integrations/test_sglang_families.py",
    "tests/runtime/test_runner_api.py",
    "tests/pallas_kernels/test_batch_checks.py",
    "tests/runtime/test_monitor.py",
    "tests/test_readme.py",
    "tests/sharded/test_sharding_subprocess.py",
    "tests/runtime/test_runner_soak.py",
    "tests/sharded/test_multiprocess.py",
)
_KERNEL_TESTS = "tests/pallas_kernels/"
_MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# XLA:CPU's backend (LLVM) optimisation level 0 for the run: the suite's programs are small, compiled once and run a
# few times, so their compile is most of CI's time and optimising the machine code costs more than it saves. The HLO
# passes (fusion, layout) still run, so the programs compute the same bytes and the HLO tests read is the same.
# ``JAX_DISABLE_MOST_OPTIMIZATIONS=0`` runs the suite on fully optimised code.
_NO_OPTIMIZATIONS_ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"
_TRUE = ("1", "true", "t", "yes", "y", "on")
_made_cache_dir: list[str] = []  # the folder this process made (the xdist controller, or a run without xdist)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): a worker per core, at most four; one process on one core, and in a pytest
    run that a test started (the sharded tests' subprocesses run beside this run's workers)."""
    if os.environ.get(_IN_RUN_ENV):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, _MAX_WORKERS) if cores > 1 else 0


def pytest_configure(config: pytest.Config) -> None:
    """Compiles each program once per run: jax's persistent cache in a fresh folder, shared by the xdist workers and by
    the subprocesses tests start (they inherit the environment).

    The suite compiles the same programs in many modules (shared fixed shapes, fresh ``jax.jit`` wrappers of one
    function, a module's caches freed below); the cache turns each repeat into a load. A folder the user set keeps
    being used, and kept.
    """
    os.environ[_IN_RUN_ENV] = "1"
    if not os.environ.get(_CACHE_ENV):
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="kvcanary-jax-cache-")
        _made_cache_dir.append(os.environ[_CACHE_ENV])
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    # Every program is cached, also in the processes tests start (the demo CLI, multi-process scenarios, servers):
    # jax reads these variables when it is imported there.
    os.environ[_MIN_COMPILE_TIME_ENV] = "0"
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # Not exported: the engines and servers tests start run many steps, so they keep optimised code (the multi-process
    # scenario, a few dozen steps, is given this level: tests/sharded/test_multiprocess.py).
    jax.config.update("jax_disable_most_optimizations", _optimisations_off())


@pytest.fixture(scope="module")
def xla_optimised():
    """Fully optimised machine code for a module whose cost is running many steps (the engine's), not compiling."""
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", _optimisations_off())


def _optimisations_off() -> bool:
    return os.environ.get(_NO_OPTIMIZATIONS_ENV, "1").lower() in _TRUE


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _made_cache_dir:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the ops' tests ``kernels`` (pyproject's markers), then puts ``_LONG_MODULES`` first, in that order, the
    others after them in collection order. xdist hands whole modules out in this order (pyproject's addopts:
    ``--dist loadfile --no-loadscope-reorder``)."""
    for item in items:
        if item.nodeid.startswith(_KERNEL_TESTS):
            item.add_marker(pytest.mark.kernels)
    rank = {module: i for i, module in enumerate(_LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def _near_limits() -> bool:
    """Whether this process holds over half its memory-map limit or over ``_MAX_RESIDENT`` bytes; True where /proc does
    not tell (every module end then frees, as before)."""
    try:
        with open("/proc/sys/vm/max_map_count") as limit, open("/proc/self/maps") as maps:
            map_share = sum(1 for _ in maps) / int(limit.read())
        with open("/proc/self/statm") as statm:
            resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return True
    return map_share > _MAX_MAP_SHARE or resident > _MAX_RESIDENT


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_executables_near_limits():
    """Frees every compiled executable at a module's end once the process nears its memory-map or memory limit.

    XLA:CPU maps every compiled kernel's code into the process (about three memory maps each) and keeps them while
    the executable is cached. A whole run compiles thousands, and past the kernel's ``vm.max_map_count`` (65530 by
    default) the next compile segfaults: the sglang-jax CI leg did, late in the run. Freeing only then keeps the
    steps that later modules share compiled (freeing at every module's end made them recompile: 23 % of the CPU
    time of four core test modules). chex's trace counters restart with the caches: a shared jitted step traces once
    more after a free, and only that once.
    """
    yield
    if _near_limits():
        jax.clear_caches()
        chex.clear_trace_counter()
        gc.collect()
