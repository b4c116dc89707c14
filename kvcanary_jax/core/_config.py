"""``CanaryConfig``: the frozen, hashable, validated settings of one canary."""

from __future__ import annotations

import dataclasses

from kvcanary_jax.core._constants import CanaryMode, RealKvHashMode
from pallas_kernels import backend as backends
from pallas_kernels import validate

_MODE_ALIASES = {"none": CanaryMode.OFF}  # SGLang spells "off" as --kv-canary none


def _parse_mode(mode) -> CanaryMode:
    if isinstance(mode, CanaryMode):
        return mode
    if isinstance(mode, str):
        key = mode.strip().lower()
        if key in _MODE_ALIASES:
            return _MODE_ALIASES[key]
        try:
            return CanaryMode(key)
        except ValueError:
            pass
    raise ValueError(f"mode must be one of {[m.value for m in CanaryMode]}; got mode={mode!r}")


def parse_real_kv_hash_mode(mode) -> RealKvHashMode:
    """A RealKvHashMode from an enum, an int, or a case-insensitive name ('none', 'partial', 'all')."""
    if isinstance(mode, str):
        try:
            return RealKvHashMode[mode.strip().upper()]
        except KeyError:
            pass
    elif validate.is_int(mode):
        try:
            return RealKvHashMode(mode)
        except ValueError:
            pass
    names = [m.name.lower() for m in RealKvHashMode]
    raise ValueError(f"real_kv_hash_mode must be one of {names} (or a RealKvHashMode); got real_kv_hash_mode={mode!r}")


def _check_int(config, name: str, minimum: int) -> None:
    """Field ``name`` must be an integer (Python or numpy) >= ``minimum``; it is stored as a Python int."""
    value = getattr(config, name)
    if not validate.is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {name}={value!r}")
    object.__setattr__(config, name, int(value))


@dataclasses.dataclass(frozen=True)
class CanaryConfig:
    """Settings of one canary; frozen and hashable, so it can be a static argument of ``jax.jit``.

    Attributes:
      mode: ``"raise"`` stops on the first violation, ``"log"`` warns and keeps serving, ``"off"`` disables.
      ring_capacity: rows in the fill-once violation ring (> 0).
      real_kv_hash_mode: NONE, PARTIAL (first 16 bytes of each slot's KV; the default) or ALL (``read_bytes``).
        PARTIAL by default, unlike SGLang's NONE: with NONE a flipped KV byte that leaves the chain intact goes
        unseen; PARTIAL catches it for +0.16 % of a decode step (README, "What each real-KV mode covers").
      sweep_interval: steps between sweeps of the prefix cache; 0 disables (needs a mode other than off).
      enable_write_input_assert: compare written tokens/positions with an oracle's expected inputs.
      enable_verify_token_assert: keep a per-request expected-token pool and check stored tokens against it.
      stats_every_n_steps: period of the stats log line; 0 disables.
      health_check_every_n_steps: period of the kernel-run watchdog; 0 disables.
      check_lag_steps: how many steps after a step the host reads its violation count (0 reads at once).
      backend: one of ``pallas_kernels.backend.BACKENDS``: ``"auto"``, ``"xla"``, ``"pallas"`` (Triton on GPU, Mosaic on
        TPU), ``"interpret"`` or ``"interpret_tpu"``.
    """

    mode: CanaryMode | str = CanaryMode.RAISE
    ring_capacity: int = 1024
    real_kv_hash_mode: RealKvHashMode | str | int = RealKvHashMode.PARTIAL
    sweep_interval: int = 0
    enable_write_input_assert: bool = False
    enable_verify_token_assert: bool = False
    stats_every_n_steps: int = 100
    health_check_every_n_steps: int = 100
    check_lag_steps: int = 4
    backend: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "mode", _parse_mode(self.mode))
        object.__setattr__(self, "real_kv_hash_mode", parse_real_kv_hash_mode(self.real_kv_hash_mode))
        _check_int(self, "ring_capacity", 1)
        for name in ("sweep_interval", "stats_every_n_steps", "health_check_every_n_steps", "check_lag_steps"):
            _check_int(self, name, 0)
        for name in ("enable_write_input_assert", "enable_verify_token_assert"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool; got {name}={getattr(self, name)!r}")
        if self.sweep_interval > 0 and self.mode is CanaryMode.OFF:
            raise ValueError(
                f"sweep_interval={self.sweep_interval} requires mode 'log' or 'raise'; got mode='off'. "
                "Set sweep_interval=0 or turn the canary on."
            )
        backends.validate(self.backend)

    @property
    def enabled(self) -> bool:
        """Whether the canary runs at all."""
        return self.mode is not CanaryMode.OFF
