"""A real engine for the demo and the tests: sglang-jax's Llama, tiny and random, on CPU, driven in-process.

Needs the ``sglang-jax`` extra (Python >= 3.12). :func:`tiny_engine` writes a small Llama ``config.json`` (no hub,
dummy load, then random weights: dummy weights give an all-zero KV cache), builds the engine's own ``ModelWorker``
with one padding bucket per mode (nothing recompiles per step), and :class:`MiniScheduler` drives it with the
engine's own ``ScheduleBatch`` helpers and ``RadixCache``, as ``Scheduler.get_new_batch_prefill`` /
``update_running_batch`` / ``run_batch`` / ``process_batch_result_*`` do (overlap off). With ``dp > 1`` requests go
to the DP ranks round robin; each rank has its own requests, KV slots and radix-cache namespace, as in the engine.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from sgl_jax.srt.managers.schedule_batch import Req, ScheduleBatch
from sgl_jax.srt.managers.tp_worker import ModelWorker
from sgl_jax.srt.mem_cache.chunk_cache import ChunkCache
from sgl_jax.srt.mem_cache.common import release_kv_cache
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.mem_cache.swa_radix_cache import SWARadixCache
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.utils.mesh_utils import create_device_mesh

from kvcanary_jax.integrations import sglang_native_swa, tiny_llama

MAX_RUNNING, TOKEN_BUCKET, MAX_TOTAL_TOKENS = 16, 256, 2048


def write_tiny_llama(directory: str | os.PathLike, *, kv_heads: int = 1) -> str:
    """Writes the tiny Llama's ``config.json`` (``kv_heads`` KV heads) into ``directory``; returns the model path."""
    return str(tiny_llama.write_config(directory, kv_heads=kv_heads))


def build_worker(
    model_path: str, *, page_size: int = 1, seed: int = 0, tp: int = 1, dp: int = 1,
    max_total_tokens: int = MAX_TOTAL_TOKENS, load_format: str = "dummy",
) -> ModelWorker:  # fmt: skip
    """The engine's ``ModelWorker`` on CPU (it builds the ``ModelRunner`` and the padding buckets), random weights:
    drawn here with ``load_format="dummy"``, else the model directory's own (``tiny-model --arch``'s are random).

    ``tp`` x ``dp`` devices on the engine's ``(data, tensor)`` mesh: ``dp`` DP ranks, each splitting its KV heads over
    ``tp`` devices (sglang-jax's ``tp_size = tp * dp``, ``dp_size = dp``). On CPU they are host-platform devices.
    """
    if tp < 1 or dp < 1 or len(jax.devices()) < tp * dp:
        raise ValueError(f"tp and dp must be >= 1 with tp * dp <= {len(jax.devices())} devices; got {tp=}, {dp=}")
    args = ServerArgs(
        model_path=model_path, device="cpu", attention_backend="native", load_format=load_format,
        skip_tokenizer_init=True, dtype="bfloat16", page_size=page_size, max_running_requests=MAX_RUNNING,
        max_total_tokens=max_total_tokens, max_prefill_tokens=TOKEN_BUCKET, chunked_prefill_size=TOKEN_BUCKET,
        precompile_bs_paddings=[MAX_RUNNING], precompile_token_paddings=[TOKEN_BUCKET],
        disable_overlap_schedule=True, disable_precompile=True, random_seed=seed, tp_size=tp * dp, dp_size=dp,
    )  # fmt: skip
    devices = jax.devices()[: tp * dp]
    mesh = create_device_mesh(ici_parallelism=[dp, tp], dcn_parallelism=[1, 1], devices=devices)  # every axis Explicit
    worker = ModelWorker(server_args=args, mesh=mesh)
    if worker.model_runner.is_hybrid:  # an SWAKVPool: the native attention's SWA path (see sglang_native_swa)
        sglang_native_swa.install()
    if load_format == "dummy":
        randomize_weights(worker.model_runner, seed=seed)
    return worker


def randomize_weights(runner, *, seed: int = 0, scale: float = 0.05) -> None:
    """Replaces every float leaf of the model state in place (keeping its sharding): N(0, scale), norms near 1."""
    leaves = runner.model_state_leaves  # the engine reads this list at each call
    key = jax.random.key(seed)
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) and x.size:
            key, sub = jax.random.split(key)
            noise = jax.random.normal(sub, x.shape, jnp.float32) * scale + (1.0 if x.ndim == 1 else 0.0)
            leaves[i] = jax.device_put(noise.astype(x.dtype), x.sharding)


@dataclasses.dataclass(frozen=True)
class Arrival:
    step: int
    rid: str
    prompt: list
    max_new_tokens: int


def workload(seed: int = 0, num_requests: int = 16) -> list[Arrival]:
    """Requests on two shared system prompts (later ones reuse prefixes the radix cache holds), a few short ones
    early (their slots become idle cache), then one new request every 3 steps."""
    rng = np.random.default_rng(seed)
    systems = [list(map(int, rng.integers(3, 500, 20))), list(map(int, rng.integers(3, 500, 13)))]
    out = []
    for i in range(num_requests):
        prompt = systems[i % 2] + list(map(int, rng.integers(3, 500, int(rng.integers(2, 10)))))
        new = int(rng.integers(3, 6)) if i in (1, 2) else int(rng.integers(12, 24))
        out.append(Arrival(0 if i < 4 else 3 * (i - 3), f"req{i}", prompt, new))
    return out


class MiniScheduler:
    """The engine's scheduling, in-process: admit requests (radix match, prefill mixed with the running decodes),
    decode, finish or cache, all with the engine's own helpers. Iterating yields one ``ScheduleBatch`` per step.

    Attributes:
      worker: the ``ModelWorker``; tree_cache: the ``RadixCache``; step: steps run so far; dp: the engine's DP ranks;
      spread: arrivals go round robin to DP ranks ``0 .. spread - 1`` (default all of them).
    """

    def __init__(self, worker: ModelWorker, arrivals: list[Arrival] | None = None, *, spread: int | None = None):
        self.worker, self.runner = worker, worker.model_runner
        self.page_size, self.dp = self.runner.page_size, int(self.runner.dp_size)
        self.spread = self.dp if spread is None else spread
        if not 1 <= self.spread <= self.dp:
            raise ValueError(f"spread must be a number of DP ranks in [1, {self.dp}]; got {spread=}")
        self.req_to_token_pool, self.allocator = worker.get_memory_pool()
        self.req_to_token_pool.clear()  # a fresh start on a reused worker
        self.allocator.clear()
        common = dict(req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
                      page_size=self.page_size)  # fmt: skip
        if worker.server_args.disable_radix_cache:  # hybrid recurrent models run without a radix cache
            self.tree_cache = ChunkCache(**common)
        elif self.runner.is_hybrid:  # an SWAKVPool: the engine's SWA tree, which frees SWA slots that leave the window
            self.tree_cache = SWARadixCache(**common, sliding_window_size=self.runner.sliding_window_size)
        else:
            self.tree_cache = RadixCache(**common)
        self.paddings = worker.get_precompile_paddings()
        self.pending = list(arrivals if arrivals is not None else workload())
        self.waiting: list[Req] = []
        self.running: ScheduleBatch | None = None
        self.finished: list[Req] = []
        self.step = 0
        self._arrived = 0

    def __iter__(self):
        while True:
            batch = self.next_batch()
            if batch is None:
                return
            yield batch

    def running_reqs(self) -> list:
        if self.running is None or self.running.is_empty():
            return []
        return [r for info in self.running.reqs_info for r in info.reqs or []]

    def next_batch(self, max_new: int = 4) -> ScheduleBatch | None:
        """Admits the step's arrivals; returns a prefill (mixed with the running decodes) or a decode batch."""
        while self.pending and self.pending[0].step <= self.step:
            a = self.pending.pop(0)
            params = SamplingParams(temperature=0, max_new_tokens=a.max_new_tokens)
            rank = self._arrived % self.spread if self.dp > 1 else None  # one rank: the engine's default
            req = Req(rid=a.rid, origin_input_text="", origin_input_ids=list(a.prompt), sampling_params=params,
                      vocab_size=self.runner.model_config.vocab_size, dp_rank=rank)  # fmt: skip
            req.sampling_params.normalize(None)
            self._arrived += 1
            self.waiting.append(req)
        if self.running is not None:
            self.running.filter_batch()  # drop the requests the last step finished
        running = self.running_reqs()
        busiest = max(collections.Counter(r.dp_rank or 0 for r in running).values(), default=0)
        room = MAX_RUNNING // self.dp - busiest  # rows left on the fullest DP rank
        if self.waiting and room > 0:
            admitted, self.waiting = self.waiting[: min(room, max_new)], self.waiting[min(room, max_new) :]
            for req in admitted:
                self.admit(req)
            per_rank = [[r for r in admitted if (r.dp_rank or 0) == k] for k in range(self.dp)]
            batch = ScheduleBatch.init_new(per_rank, self.req_to_token_pool, self.allocator, self.tree_cache,
                                           self.runner.model_config, enable_overlap=False, dp_size=self.dp,
                                           mesh=self.runner.mesh)  # fmt: skip
            batch.prepare_for_extend()
            if running:  # one EXTEND batch: the new prompts plus one token of every running request
                self.running.prepare_for_decode()
                batch.mix_with_running(self.running)
                for info, old in zip(batch.reqs_info, self.running.reqs_info, strict=True):
                    info.decoding_reqs = old.reqs
                self.running = None
            return batch
        if not running:
            return None if not self.pending else self._idle_step()
        self.running.prepare_for_decode()
        return self.running

    def admit(self, req) -> None:
        """The radix match of a request let in (``prefix_indices``, ``last_node``), its prefix locked."""
        req.init_next_round_input(self.tree_cache)
        locked = self.tree_cache.inc_lock_ref(req.last_node)
        req.swa_uuid_for_lock = getattr(locked, "swa_uuid_for_lock", None)  # the SWA tree's window lock

    def _idle_step(self):
        self.step = self.pending[0].step
        return self.next_batch()

    def model_worker_batch(self, batch: ScheduleBatch):
        """``ScheduleBatch.get_model_worker_batch`` with the worker's padding buckets."""
        return batch.get_model_worker_batch(*self.paddings, self.page_size)

    def run_batch(self, batch: ScheduleBatch, model_worker_batch=None) -> np.ndarray:
        """As ``Scheduler.run_batch`` then ``process_batch_result``: forward and sample, then the requests' results."""
        mwb = model_worker_batch if model_worker_batch is not None else self.model_worker_batch(batch)
        _, next_ids, _ = self.worker.forward_batch_generation(mwb)
        next_ids = np.asarray(jax.device_get(next_ids))
        self.process_result(batch, next_ids)
        return next_ids

    def process_result(self, batch: ScheduleBatch, next_ids: np.ndarray) -> None:
        """Appends each request's token (DP rank ``k``'s rows start at ``k * per_dp_bs_size``); finished requests go
        to the radix cache, new prefills are cached."""
        is_extend = batch.forward_mode.is_extend()
        for rank, info in enumerate(batch.reqs_info):
            reqs = info.reqs or []
            base = rank * batch.per_dp_bs_size
            decoding = {id(r) for r in info.decoding_reqs or []}
            for req, token in zip(reqs, next_ids[base : base + len(reqs)], strict=True):
                req.output_ids.append(int(token))
                req.check_finished()
                if req.finished():
                    release_kv_cache(req, self.tree_cache)
                    self.finished.append(req)
                elif is_extend and id(req) not in decoding:
                    self.tree_cache.cache_unfinished_req(req)  # others can match its prompt now
            info.output_ids = np.asarray(next_ids[base : base + len(reqs)], np.int32)
        if is_extend:
            batch.filter_batch()
            if not batch.is_empty():
                if self.running is None or self.running.is_empty():
                    self.running = batch
                else:
                    self.running.merge_batch(batch)
        self.step += 1


def tiny_engine(page_size: int = 1, *, model_dir: str | None = None, seed: int = 0, tp: int = 1, dp: int = 1):
    """``(worker, scheduler)``: the tiny Llama's ``ModelWorker`` and a :class:`MiniScheduler` over the workload.

    Under tensor parallelism (``tp > 1``) the model has ``tp`` KV heads, one per device (the engine splits KV heads,
    and refuses fewer heads than devices).
    """
    path = write_tiny_llama(model_dir or tempfile.mkdtemp(prefix="kvcanary_tiny_llama_"), kv_heads=max(1, tp))
    worker = build_worker(path, page_size=page_size, seed=seed, tp=tp, dp=dp)
    return worker, MiniScheduler(worker, workload(seed))
