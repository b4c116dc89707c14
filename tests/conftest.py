"""Shared pytest set-up: the package's own pytest plugin (the ``kvcanary_guard`` fixture) for every test."""

pytest_plugins = ["kvcanary_jax.testing.pytest_plugin"]
