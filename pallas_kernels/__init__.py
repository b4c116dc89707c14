"""Lower layer of kvcanary-jax: array-in, array-out canary ops with an XLA path and Pallas kernels.

The ops, each in its own folder behind its ``api`` module (the contract: signature, checks, backend dispatch):

* ``pallas_kernels.verify.api.verify``: per-entry fail bits of a verify plan (SGLang's ``canary_verify``).
* ``pallas_kernels.write.api.write``: one write launch's chain walk and record store (SGLang's ``canary_write``).
* ``pallas_kernels.phase.api.phase``: one HEAD or TAIL phase of a group, fused: plans, both halves' verify and
  write, ring rows and counters (the runner's only way to run a phase, on every backend).
* ``pallas_kernels.batch_checks.api.check``: a batch's rows and new slots checked, and the rows' roles.

Each op has a pure-jnp ``reference``, a ``pallas_triton`` (GPU) and, where TPU kernels exist, a ``pallas_mosaic``
(verify, write, phase); ``pallas_kernels.backend`` names the backends and dispatches between them. The
contract (signature, docstring, checks) is stated once, in ``api``; the kernel backends of verify and write
supply only their forward to the one entry point in their op's ``base``.
"""

from pallas_kernels.realkv import RealKvSource as RealKvSource

__all__ = ["RealKvSource"]
