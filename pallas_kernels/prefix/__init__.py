"""prefix op: inclusive prefix sums (``api.inclusive_sum``), one implementation on every backend."""

from pallas_kernels.prefix.api import PAIRWISE_MAX_ENTRIES as PAIRWISE_MAX_ENTRIES
from pallas_kernels.prefix.api import inclusive_sum as inclusive_sum

__all__ = ["PAIRWISE_MAX_ENTRIES", "inclusive_sum"]
