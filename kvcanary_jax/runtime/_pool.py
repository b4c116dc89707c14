"""What the runner needs to know about the user's KV pool: slot counts, page size, the SWA group, real-KV sources."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax.core._constants import CanaryLaunchTag, Half, Phase, PoolKind, launch_tag
from pallas_kernels import realkv, validate
from pallas_kernels.realkv import RealKvSource, check_kv_dtype

PADDINGS = ("negative", "reserved", "none")


def _positive(obj, cls_name: str, name: str) -> None:
    """Checks that field ``name`` is a positive integer (Python or numpy) and stores it as a Python int."""
    value = getattr(obj, name)
    if not validate.is_int(value) or value <= 0:
        raise ValueError(f"{cls_name}.{name} must be a positive int; got {name}={value!r}")
    object.__setattr__(obj, name, int(value))


@dataclasses.dataclass(frozen=True)
class SwaGroup:
    """The sliding-window sub-pool of a hybrid model (SGLang's SWAKVPool).

    Its slots are addressed through the full->SWA table (``full_to_swa_index_mapping``), which travels with each
    batch because it changes as windows slide. Per-forward verify covers only the last ``window`` cached positions.

    Attributes:
      num_slots: slots of the SWA pool (slot 0 is padding).
      window: sliding-window length in tokens (> 0).
      page_size: slots per page of the SWA KV arrays; None = the full pool's page size.
      verify_capacity: most verify entries per forward; None = 3 * num_slots (SGLang's sizing).
    """

    num_slots: int
    window: int
    page_size: int | None = None
    verify_capacity: int | None = None

    def __post_init__(self):
        for name in ("num_slots", "window", "page_size", "verify_capacity"):
            if getattr(self, name) is not None or name in ("num_slots", "window"):
                _positive(self, "SwaGroup", name)
        if self.num_slots < 2:
            raise ValueError(
                f"SwaGroup.num_slots must be >= 2 (slot 0 is the reserved padding slot); got num_slots={self.num_slots}"
            )


@dataclasses.dataclass(frozen=True)
class CanaryPool:
    """Static description of the KV pool the canary shadows.

    Attributes:
      num_slots: token slots of the full pool, including padding slot 0 (the canary keeps one record per slot).
      page_size: slots per page of the KV arrays: slot ``s`` lives at ``[s // page_size, s % page_size]``.
      swa: the optional sliding-window group (a :class:`SwaGroup`).
      with_v: also launch the V-half endpoints (SGLang launches K only unless ENABLE_MHA_V).
      verify_capacity: most FULL verify entries per forward (sum of cached prefix lengths in a batch); None =
        3 * num_slots. A batch over capacity skips its verify for that step (counted as an overflow).
      max_reqs, max_context_len: shape of ``req_to_token``; needed only for the verify-token assert, which keeps a
        per-request expected-token pool of that shape.
      kv_token_id_vs_position_offset: the token whose KV sits at position p is token p + offset (1 for an EAGLE
        draft pool; 0 otherwise).
      padding: how the engine marks padding in a batch (slot 0 is always the canary's reserved padding slot):

        - ``"negative"`` (default): padding rows have ``req_pool_indices < 0`` and padding tokens
          ``out_cache_loc < 0``; every ``req_to_token`` row, row 0 included, can hold a request (sglang-jax, vLLM).
        - ``"reserved"``: SGLang's: ``req_to_token`` row 0 is the padding row (``req_pool_indices == 0``), whose
          tokens may write slot 0; a request in row 0 is an ``INVALID_INPUT`` violation.
        - ``"none"``: every batch row is a request; a negative ``req_pool_indices`` is a violation.
    """

    num_slots: int
    page_size: int = 1
    swa: SwaGroup | None = None
    with_v: bool = True
    verify_capacity: int | None = None
    max_reqs: int | None = None
    max_context_len: int | None = None
    kv_token_id_vs_position_offset: int = 0
    padding: str = "negative"

    def __post_init__(self):
        for name in ("num_slots", "page_size", "verify_capacity", "max_reqs", "max_context_len"):
            if getattr(self, name) is not None or name in ("num_slots", "page_size"):
                _positive(self, "CanaryPool", name)
        if self.num_slots < 2:
            raise ValueError(
                f"CanaryPool.num_slots must be >= 2 (slot 0 is the reserved padding slot); got num_slots={self.num_slots}"
            )
        if self.padding not in PADDINGS:
            raise ValueError(f"CanaryPool.padding must be one of {PADDINGS}; got padding={self.padding!r}")
        if self.swa is not None and not isinstance(self.swa, SwaGroup):
            raise TypeError(f"CanaryPool.swa must be a SwaGroup or None; got {type(self.swa).__name__}")
        if not isinstance(self.with_v, bool):
            raise TypeError(f"CanaryPool.with_v must be a bool; got with_v={self.with_v!r}")
        if not validate.is_int(self.kv_token_id_vs_position_offset):
            raise TypeError(
                f"kv_token_id_vs_position_offset must be an int; got {self.kv_token_id_vs_position_offset!r}"
            )
        object.__setattr__(self, "kv_token_id_vs_position_offset", int(self.kv_token_id_vs_position_offset))

    @property
    def groups(self) -> tuple[Group, ...]:
        """The buffer groups, FULL first (SGLang's launch order)."""
        full = Group(PoolKind.FULL, self.num_slots, self.page_size, 0, self.verify_capacity or 3 * self.num_slots)
        if self.swa is None:
            return (full,)
        s = self.swa
        swa = Group(
            PoolKind.SWA, s.num_slots, s.page_size or self.page_size, s.window, s.verify_capacity or 3 * s.num_slots
        )
        return (full, swa)


def halves(pool: CanaryPool) -> tuple[Half, ...]:
    """The halves the pool's launches cover: K, and V when ``pool.with_v``."""
    return (Half.K, Half.V) if pool.with_v else (Half.K,)


@dataclasses.dataclass(frozen=True)
class Group:
    """One buffer group as the runner uses it (derived from :class:`CanaryPool`)."""

    kind: PoolKind
    num_slots: int
    page_size: int
    window: int
    verify_capacity: int

    @property
    def name(self) -> str:
        return self.kind.name.lower()

    def tag(self, phase: Phase, half: Half) -> CanaryLaunchTag:
        """The launch tag of ``phase`` and ``half`` in this group."""
        return launch_tag(phase, half, self.kind)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupBuffers:
    """A group's canary buffers, each ``u32[num_slots, 4, 2]``; the V pair is None when V is not launched.

    HEAD launches use the head buffers; TAIL and SWEEP launches use the tail buffers, as in SGLang.
    """

    k_head: jax.Array
    k_tail: jax.Array
    v_head: jax.Array | None = None
    v_tail: jax.Array | None = None

    @staticmethod
    def field_name(phase: Phase, half: Half) -> str:
        """The attribute holding ``phase``'s ``half`` buffer, e.g. ``k_tail``."""
        return f"{half.name.lower()}_{'head' if phase is Phase.HEAD else 'tail'}"

    def buffer(self, phase: Phase, half: Half) -> jax.Array:
        """The buffer ``phase``'s ``half`` launches read and write."""
        return getattr(self, self.field_name(phase, half))

    def with_buffer(self, phase: Phase, half: Half, buf: jax.Array) -> GroupBuffers:
        return dataclasses.replace(self, **{self.field_name(phase, half): buf})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KvSources:
    """Which KV bytes feed REAL_KV_HASH, per group and half (SGLang folds layer 0's K and V rows).

    Each field is a tuple of up to 4 :class:`RealKvSource`; build it with :meth:`KvCanary.kv_sources`. The same
    sources must be given to ``after_forward`` and ``sweep``: the TAIL write stores the fold, the later TAIL and
    SWEEP verifies recompute it.
    """

    full_k: tuple[RealKvSource, ...] = ()
    full_v: tuple[RealKvSource, ...] = ()
    swa_k: tuple[RealKvSource, ...] = ()
    swa_v: tuple[RealKvSource, ...] = ()

    def get(self, group: Group, half: Half) -> tuple[RealKvSource, ...]:
        return getattr(self, f"{group.name}_{half.name.lower()}")


def as_sources(name: str, value, page_size: int, num_slots: int) -> tuple[RealKvSource, ...]:
    """One field of :class:`KvSources` from None, an array, a RealKvSource, or a sequence of those.

    An array must be paged as the pool is: ``[pages, page_size, ...]``, page axis first, covering every slot of
    the group. (A :class:`RealKvSource` states its own layout; only its coverage of the group is checked.)
    """
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else (value,)
    out = []
    for i, item in enumerate(items):
        arg = name if len(items) == 1 and not isinstance(value, (list, tuple)) else f"{name}[{i}]"
        if isinstance(item, RealKvSource):
            out.append(item)
        elif hasattr(item, "shape") and hasattr(item, "dtype"):
            out.append(RealKvSource(check_paged_kv(arg, item, page_size, num_slots), page_size=page_size))
        else:
            raise TypeError(f"{arg} must be a KV array or a RealKvSource; got {type(item).__name__}")
    sources = realkv.validate_sources(tuple(out), num_slots=num_slots, arg=name)  # too few slots: named there
    for i, source in enumerate(sources):
        check_covers_pool(name if len(sources) == 1 and not isinstance(value, (list, tuple)) else f"{name}[{i}]",
                          source, num_slots)  # fmt: skip
    return sources


def check_covers_pool(arg: str, source: RealKvSource, num_slots: int) -> None:
    """A source's pages hold exactly the group's slots: with more, a slot would read another slot's KV bytes.

    The usual cause is a flat per-slot array ``[num_slots, heads, dim]`` whose head count equals the pool's page
    size: it passes for ``num_slots`` pages of ``page_size`` slots each, and slot ``s`` is then read at flat row ``s //
    page_size`` (with a page of 2, a fault in slot 5's KV is reported at slot 10).

    Raises:
      ValueError: naming the source, its pages x page_size and the group's num_slots, with the reshape that fits.
    """
    pages, page_size = int(source.data.shape[0]), source.page_size
    if pages * page_size == num_slots:
        return
    shape = tuple(source.data.shape)
    hint = _flat_hint(shape, page_size, num_slots) if page_size > 1 else ""
    raise ValueError(
        f"{arg} holds {pages} pages x page_size={page_size} = {pages * page_size} token slots, but the pool group "
        f"has num_slots={num_slots}: a source must hold exactly the group's slots (slot s at page s // page_size, "
        f"row s % page_size); got shape {shape}.{hint}"
    )


def _flat_hint(shape: tuple[int, ...], page_size: int, num_slots: int) -> str:
    """The fix for a flat per-slot array ``[num_slots, heads, dim]`` (its leading axis the slots), or ``""``."""
    if not shape or shape[0] != num_slots or num_slots <= 0:
        return ""
    if num_slots % page_size:
        return (
            f" Its leading axis holds the {num_slots} slots: a flat per-slot array [slots, heads, dim]; view it as "
            f"[slots, 1, heads * dim] (kv.reshape({num_slots}, 1, -1)) with page_size=1 (CanaryPool.page_size)."
        )
    rest = "".join(f", {d}" for d in shape[1:])
    return (
        f" Its leading axis holds the {num_slots} slots: it looks like a flat per-slot array [slots, heads, dim], "
        f"not [pages, page_size, ...]. View it paged as the pool is: kv.reshape({num_slots // page_size}, "
        f"{page_size}{rest})"
    )


def check_paged_kv(arg: str, kv, page_size: int, num_slots: int):
    """``kv`` as a jax array, checked to be laid out ``[pages, page_size, ...]`` and to cover ``num_slots``."""
    check_kv_dtype(kv.dtype, arg)
    shape = tuple(kv.shape)
    if len(shape) < 2 or shape[1] != page_size:
        hint = _flat_hint(shape, page_size, num_slots)
        # A later page axis: only the axis after heads (head_dim may equal the page size too).
        if not hint and len(shape) >= 4 and shape[2] == page_size:
            hint = (
                f" The page_size ({page_size}) is a later axis: a head-major [pages, heads, page_size, dim] array "
                "is not laid out per slot; pass a slot-major view, or a RealKvSource stating the layout."
            )
        elif not hint and len(shape) >= 2:
            hint = (
                f" Its pages hold {shape[1]} slots: if the engine pages KV by {shape[1]}, the canary's page_size "
                "must say so (CanaryPool.page_size, or SwaGroup.page_size for the SWA group)."
            )
        raise ValueError(
            f"{arg} must be a paged KV array laid out [pages, page_size={page_size}, ...] (CanaryPool.page_size, "
            f"page axis first, then the slot within its page); got shape {shape}.{hint}"
        )
    if shape[0] * page_size < num_slots:
        raise ValueError(
            f"{arg} holds {shape[0]} pages x {page_size} = {shape[0] * page_size} slots, fewer than the group's "
            f"num_slots={num_slots}: every canary slot needs KV bytes"
        )
    return jnp.asarray(kv) if isinstance(kv, np.ndarray) else kv
