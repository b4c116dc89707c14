"""The engine's tests run its model for many steps: they compile optimised code (``xla_optimised``)."""

import pytest


@pytest.fixture(autouse=True, scope="module")
def _engine_runs_optimised(xla_optimised):
    yield
