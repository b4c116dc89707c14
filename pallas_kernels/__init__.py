"""Lower layer of kvcanary-jax: array-in, array-out canary ops with an XLA path and Pallas kernels.

The ops live in ``pallas_kernels.verify.api.verify`` and ``pallas_kernels.write.api.write``.
"""

from pallas_kernels.realkv import RealKvSource as RealKvSource

__all__ = ["RealKvSource"]
