"""Ready-made wrappers of real JAX engines; each is an optional extra, imported on its own.

* :mod:`kvcanary_jax.integrations.sglang_jax`: sglang-jax's ``ModelRunner`` (``pip install
  "kvcanary-jax[sglang-jax]"``, Python >= 3.12).
* :mod:`kvcanary_jax.integrations.sglang_hicache`: the canary's records carried across sglang-jax's HiCache host pool.

A wrapper module imports only the public surface of ``kvcanary_jax`` and imports its engine when it is used, so
``import kvcanary_jax.integrations.sglang_jax`` works without the extra and its entry points say what to install.
"""
