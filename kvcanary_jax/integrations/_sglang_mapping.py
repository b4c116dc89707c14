"""sglang-jax's structures as the canary's: its layout, KV layers, page table, batches, token history and radix cache.

The bottom of the sglang-jax integration: functions of the engine's data, no guard. What each maps is in
:mod:`kvcanary_jax.integrations.sglang_jax`'s docstring.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import kvcanary_jax as kc

INSTALL_HINT = (
    'kvcanary_jax.integrations.sglang_jax needs sglang-jax: pip install "kvcanary-jax[sglang-jax]" '
    "(Python >= 3.12; it installs sglang-jax[cpu]==0.1.0rc0, the release on jax 0.10.2)"
)
_FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "cache_loc",
           "extend_prefix_lens", "extend_seq_lens")  # fmt: skip
_MIN_CAPACITY = 256  # the smallest plan a forward (or an adoption) is sized for
_LADDER_STEP = 4  # each plan size is this many times the one below it


def require_sglang_jax():
    """Imports ``sgl_jax``; raises ``ImportError`` saying how to install the extra when it is missing."""
    try:
        return importlib.import_module("sgl_jax")
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err


# --- the engine's batch as the canary's (traced) ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static facts of one engine, closed over by the jits.

    Attributes:
      page_size: slots per KV page.
      table_width: columns of the device-built page table: the longest sequence, rounded up to a page.
    """

    page_size: int
    table_width: int


def kv_sources(kv0: jax.Array) -> tuple[kc.RealKvSource, kc.RealKvSource]:
    """K and V of one fused layer array as two real-KV sources, views of the same array (no copy).

    ``kv0`` is ``[pages, page_size, 2 * kv_heads // packing, packing, head_dim]``: per token, fused head ``j`` sits at
    byte ``j * head_bytes``, K of head ``h`` at ``j = 2h`` and V at ``2h + 1``.
    """
    if kv0.ndim != 5:
        raise ValueError(
            "kv0 must be sglang-jax's fused layer array [pages, page_size, 2 * kv_heads // packing, packing, "
            f"head_dim]; got shape {tuple(kv0.shape)}"
        )
    _, page_size, fused, packing, head_dim = kv0.shape
    head_bytes = head_dim * jnp.dtype(kv0.dtype).itemsize
    kv_heads = fused * packing // 2
    common = dict(page_size=page_size, read_bytes=kv_heads * head_bytes, segment_bytes=head_bytes,
                  segment_stride=2 * head_bytes)  # fmt: skip
    return kc.RealKvSource(kv0, byte_offset=0, **common), kc.RealKvSource(kv0, byte_offset=head_bytes, **common)


def mla_source(kv0: jax.Array, page_size: int) -> kc.RealKvSource:
    """Layer 0's latent rows of an ``MLATokenToKVPool`` as one real-KV source (a view, no copy).

    ``kv0`` is ``[pages, align(page_size, packing) // packing, packing, kv_dim]`` with ``kv_dim = align(kv_lora_rank,
    128) + align(qk_rope_head_dim, 128)``: the packed axes are token-major (token ``t`` of a page is row
    ``t // packing``, lane ``t % packing``), so token ``t``'s row starts at byte ``t * kv_dim * itemsize`` of its page.
    The source reads from there: PARTIAL the row's first 16 bytes (``c_kv``), ALL the whole row (``c_kv``, its padding,
    ``k_pe`` and its padding).
    """
    if kv0.ndim != 4 or kv0.shape[1] * kv0.shape[2] < page_size:
        raise ValueError(
            "kv0 must be sglang-jax's MLA layer array [pages, align(page_size, packing) // packing, packing, kv_dim] "
            f"holding page_size={page_size} tokens a page; got shape {tuple(kv0.shape)}"
        )
    row_bytes = kv0.shape[3] * jnp.dtype(kv0.dtype).itemsize
    return kc.RealKvSource(kv0, page_size=page_size, num_bytes_per_token=row_bytes, read_bytes=row_bytes)


def _inclusive_sum(x: jax.Array) -> jax.Array:
    """``cumsum`` as one ``reduce_window`` (jax 0.12 lowers ``jnp.cumsum`` for CUDA to a while loop)."""
    n = x.shape[0]
    return lax.reduce_window(x, jnp.zeros((), x.dtype), lax.add, (n,), (1,), [(n - 1, 0)])


def page_table(cache_loc: jax.Array, seq_lens: jax.Array, layout: Layout) -> jax.Array:
    """i32[bs, W]: row ``b`` holds batch row b's first ``seq_lens[b]`` slots as attention reads them, 0 past them.

    ``cache_loc`` holds every row's slots end to end, each row padded to a whole page (DP = 1).
    """
    ps, width = layout.page_size, layout.table_width
    aligned = (seq_lens + ps - 1) // ps * ps
    starts = _inclusive_sum(aligned) - aligned
    col = jnp.arange(width, dtype=jnp.int32)
    index = jnp.clip(starts[:, None] + col[None, :], 0, cache_loc.shape[0] - 1)
    return jnp.where(col[None, :] < seq_lens[:, None], cache_loc[index], 0).astype(jnp.int32)


def canary_batch(
    fields: dict, layout: Layout, *, is_decode: bool, oracle: dict, pool_fields: dict | None = None
) -> kc.CanaryBatch:
    """The engine's ``ForwardBatch`` arrays (``fields``) as a :class:`kvcanary_jax.CanaryBatch`; traced.

    Args:
      fields: ``input_ids, positions, out_cache_loc`` (i32[T]), ``req_pool_indices, seq_lens`` (i32[bs]),
        ``cache_loc``, and for EXTEND / MIXED ``extend_prefix_lens, extend_seq_lens`` (i32[bs]).
      layout: the engine's :class:`Layout`.
      is_decode: a DECODE batch (no extend arrays).
      oracle: ``expected_input_ids`` (i32[T]) and / or ``token_ids`` (i32[max_bs, W]) with ``token_ids_lens``
        (i32[bs]), from :func:`token_oracle`; empty when the token asserts are off. Under the overlap scheduler it
        also holds ``future_map``: a negative expected id ``-k`` means "the token at ``future_map[k]``".
      pool_fields: the batch fields the engine's KV pool gives (:meth:`PoolView.batch_fields`, e.g. the full->SWA
        slot table).
    """
    if not jax.sharding.get_abstract_mesh().empty:  # P("data") on the engine's mesh: the mapping works replicated
        fields = {k: jax.sharding.reshard(v, P()) for k, v in fields.items()}
        oracle = {k: jax.sharding.reshard(v, P()) for k, v in oracle.items()}
        pool_fields = {k: jax.sharding.reshard(v, P()) for k, v in (pool_fields or {}).items()}
    fields, oracle = dict(fields), dict(oracle)
    future_map = fields.pop("future_map", None)
    if future_map is not None:  # the overlap scheduler's placeholders, resolved as the engine resolves them
        fields["input_ids"] = resolve_future(fields["input_ids"], future_map)
        if "expected_input_ids" in oracle:
            oracle["expected_input_ids"] = resolve_future(oracle["expected_input_ids"], future_map)
    rpi, seq_lens = fields["req_pool_indices"].astype(jnp.int32), fields["seq_lens"].astype(jnp.int32)
    real = (rpi >= 0) & (seq_lens > 0)
    rows = jnp.where(real, jnp.arange(rpi.shape[0], dtype=jnp.int32), -1)
    seq_lens = jnp.where(real, seq_lens, 0)
    if is_decode:
        prefix, extend = jnp.where(real, seq_lens - 1, 0), real.astype(jnp.int32)
    else:
        prefix = jnp.where(real, fields["extend_prefix_lens"], 0).astype(jnp.int32)
        extend = jnp.where(real, fields["extend_seq_lens"], 0).astype(jnp.int32)
    return kc.CanaryBatch(
        req_pool_indices=rows,
        prefix_lens=prefix,
        extend_lens=extend,
        req_to_token=page_table(fields["cache_loc"].astype(jnp.int32), seq_lens, layout),
        input_ids=fields["input_ids"].astype(jnp.int32),
        positions=fields["positions"].astype(jnp.int32),
        out_cache_loc=fields["out_cache_loc"].astype(jnp.int32),
        **oracle,
        **(pool_fields or {}),
    )


def resolve_future(ids: jax.Array, future_map: jax.Array) -> jax.Array:
    """A negative id ``-k`` is the token at ``future_map[k]`` (sglang-jax's ``resolve_future_token_ids``); traced."""
    return jnp.where(ids < 0, future_map[jnp.clip(-ids, 0, future_map.shape[0] - 1)], ids)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The one shape per kind of forward the canary's programs see, whatever bucket the engine padded a batch to.

    The engine pads a batch to one of its buckets (rows, tokens, ``cache_loc``); the canary pads it further, on the
    host, to the largest, so its HEAD and TAIL compile once per kind and plan size (at startup, see
    :meth:`SglangCanary.precompile`), never per bucket, and a smaller bucket is never refused.

    Attributes:
      rows: batch rows (the largest batch-size bucket).
      decode_tokens: a DECODE batch's tokens (one per row: the largest batch-size bucket).
      extend_tokens: an EXTEND or MIXED batch's tokens (the largest token bucket).
      cache_loc: ``cache_loc`` entries (the largest ``cache_loc`` bucket).
    """

    rows: int
    decode_tokens: int
    extend_tokens: int
    cache_loc: int

    @classmethod
    def of(cls, worker) -> Shapes:
        """From the engine's buckets (``get_precompile_paddings``)."""
        token_buckets, bs_buckets, cache_loc_buckets = worker.get_precompile_paddings()
        rows = int(max(bs_buckets))
        return cls(rows=rows, decode_tokens=rows, extend_tokens=max(int(max(token_buckets)), rows),
                   cache_loc=int(max(cache_loc_buckets)))  # fmt: skip

    def tokens(self, is_decode: bool) -> int:
        return self.decode_tokens if is_decode else self.extend_tokens


def _padded(x, n: int, fill: int, what: str) -> np.ndarray:
    """``x`` as i32[n], its tail ``fill``; a longer ``x`` is an engine set-up the canary was not sized for."""
    x = np.asarray(x, np.int32).reshape(-1)
    if x.shape[0] > n:
        raise ValueError(f"the engine's batch has {x.shape[0]} {what}, more than the largest bucket ({n}) the canary "
                         "was sized for at startup")  # fmt: skip
    out = np.full(n, fill, np.int32)
    out[: x.shape[0]] = x
    return out


def host_fields(model_worker_batch, shapes: Shapes, *, is_decode: bool) -> dict:
    """The ``ModelWorkerBatch``'s arrays the mapping reads, copied and padded to ``shapes`` (numpy).

    Padding follows the engine's own: rows ``req_pool_indices = -1`` with no tokens, tokens ``out_cache_loc = -1``
    (not written). A copy, as the engine reuses its host buffers (``cache_loc``) for the next batch.
    """
    mwb, t, r = model_worker_batch, shapes.tokens(is_decode), shapes.rows
    fields = {
        "input_ids": _padded(mwb.input_ids, t, 0, "tokens"),
        "positions": _padded(mwb.positions, t, 0, "tokens"),
        "out_cache_loc": _padded(mwb.out_cache_loc, t, -1, "tokens"),
        "req_pool_indices": _padded(mwb.req_pool_indices, r, -1, "rows"),
        "seq_lens": _padded(mwb.seq_lens, r, 0, "rows"),
        "cache_loc": _padded(mwb.cache_loc, shapes.cache_loc, 0, "cache_loc entries"),
    }
    if not is_decode:
        fields["extend_prefix_lens"] = _padded(mwb.extend_prefix_lens, r, 0, "rows")
        fields["extend_seq_lens"] = _padded(mwb.extend_seq_lens, r, 0, "rows")
    return fields


def padded_oracle(oracle: dict, shapes: Shapes, *, is_decode: bool) -> dict:
    """A :func:`token_oracle` padded to ``shapes`` as :func:`host_fields` pads the batch."""
    out = dict(oracle)
    if "expected_input_ids" in out:
        out["expected_input_ids"] = _padded(out["expected_input_ids"], shapes.tokens(is_decode), 0, "tokens")
    if "token_ids_lens" in out:
        out["token_ids_lens"] = _padded(out["token_ids_lens"], shapes.rows, 0, "rows")
    return out


def capacity_ladder(limit: int) -> tuple[int, ...]:
    """The plan capacities a forward may run with: 256, then x4 each, up to ``limit`` (the largest ``cache_loc``
    bucket), which ends the ladder. Each is a HEAD and a TAIL program per kind of forward, compiled at startup; x4
    keeps that to a few programs while a plan stays within 4x of what its batch verifies."""
    sizes = [min(_MIN_CAPACITY, limit)]
    while sizes[-1] < limit:
        sizes.append(min(limit, sizes[-1] * _LADDER_STEP))
    return tuple(sizes)


def sized_capacity(need: int, limit: int) -> int:
    """The plan capacity for ``need`` entries: the smallest of :func:`capacity_ladder` that holds them (at most
    ``limit``).

    The canary's work scales with its plan's capacity, not with what the plan lists: a few sizes keep it near the
    batch's own size at a few programs per kind of forward.
    """
    return next((c for c in capacity_ladder(limit) if c >= need), limit)


def verify_need(model_worker_batch) -> int:
    """At least the entries a forward of this batch verifies (the real rows' cached prefixes): the rows' ``seq_lens``
    summed (host numpy)."""
    rpi, seq_lens = np.asarray(model_worker_batch.req_pool_indices), np.asarray(model_worker_batch.seq_lens)
    return int(np.sum(seq_lens, where=(rpi >= 0) & (seq_lens > 0)))


def batch_fields(forward_batch) -> dict:
    """The ``ForwardBatch`` arrays the mapping reads."""
    return {k: getattr(forward_batch, k) for k in _FIELDS if getattr(forward_batch, k, None) is not None}


# --- host side: the token oracle, the radix walk, the live requests ------------------------------------------------


def token_oracle(reqs, model_worker_batch, layout: Layout, *, max_bs: int, write: bool, verify: bool) -> dict:
    """The requests' own history (``origin_input_ids + output_ids``) laid out as the batch (numpy).

    Returns ``expected_input_ids`` (i32[T]: each token the forward must write) when ``write``, and ``token_ids``
    (i32[max_bs, W]: each row's known tokens) with ``token_ids_lens`` (i32[bs]) when ``verify``. Under the overlap
    scheduler a row's history may lag its batch by one token (sampled by the previous forward, not yet on the host):
    that token's expected id is ``-(req_pool_idx + 1)``, the row's own future-map entry, resolved on device.
    """
    mwb = model_worker_batch
    num_tokens, bs = len(mwb.input_ids), len(mwb.seq_lens)
    is_decode = mwb.forward_mode.is_decode()
    expected = np.zeros(num_tokens, np.int32)
    table = np.zeros((max_bs, layout.table_width), np.int32)
    lens = np.zeros(bs, np.int32)
    t = 0
    for b, req in enumerate(reqs):
        history = list(req.origin_input_ids) + list(req.output_ids)
        seq = int(mwb.seq_lens[b])
        n = 1 if is_decode else int(mwb.extend_seq_lens[b])
        if seq > len(history) + 1:
            raise ValueError(
                f"request {req.rid!r}: the batch runs {seq} tokens but its history holds {len(history)} (at most one "
                "may be pending, under the overlap scheduler)"
            )
        lagged = history + [-(int(mwb.req_pool_indices[b]) + 1)] * max(0, seq - len(history))
        expected[t : t + n] = lagged[seq - n : seq]
        t += n
        known = min(len(history), layout.table_width)
        table[b, :known] = history[:known]
        lens[b] = known
    out = {}
    if write:
        out["expected_input_ids"] = expected
    if verify:
        out["token_ids"], out["token_ids_lens"] = table, lens
    return out


def radix_entries(tree_cache, *, include=None) -> kc.SweepEntries:
    """Every slot a ``RadixCache`` holds, as (slot, position = depth, predecessor) entries.

    ``include(node)``, if given, keeps only the slots of the nodes it accepts (e.g. ``lambda n: n.lock_ref == 0``:
    the slots no running request holds).
    """
    return kc.walk_prefix_tree(
        tree_cache.root_node,
        children=lambda node: [c for c in node.children.values() if c.value is not None],
        slots=lambda node: np.asarray(node.value, np.int32),
        include=include,
    )


def unlocked(node) -> bool:
    """No running request holds the radix node (``RadixCache``'s ``lock_ref``, ``SWARadixCache``'s
    ``full_lock_ref``): its slots are idle cache."""
    return getattr(node, "lock_ref", getattr(node, "full_lock_ref", 0)) == 0


def scheduler_requests(scheduler) -> list:
    """The live requests of an sglang-jax ``Scheduler`` between steps (DP rank 0): the running batch's, the last
    batch's (a prefill not merged yet) and the chunked request, each once."""
    reqs = {}
    for batch in (getattr(scheduler, "running_batch", None), getattr(scheduler, "last_batch", None)):
        for info in getattr(batch, "reqs_info", None) or []:
            for req in info.reqs or []:
                reqs.setdefault(id(req), req)
    for req in getattr(scheduler, "chunked_reqs", None) or []:
        if req is not None:
            reqs.setdefault(id(req), req)
    return [r for r in reqs.values() if r.req_pool_idx is not None and not r.finished()]


def is_overlap_client(worker) -> bool:
    """The overlap scheduler's ``ModelWorkerClient`` (a ``ModelWorker`` in ``.worker``, a future-token map)."""
    return hasattr(worker, "future_token_ids_map") and hasattr(worker, "worker")
