"""Times the xla-path write chain for a bs=8 x 4096-token prefill on the local backend (CPU by default).

Usage: python benchmarks/bench_write_chain_cpu.py [--block B ...] [--reps N]
Prints compile time (first call) and the median of N timed calls for each chain block size.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.write import reference


def _inputs(batch: int, chunk: int):
    num_tokens = batch * chunk
    rng = np.random.default_rng(0)
    return dict(
        canary_buf=jnp.zeros((num_tokens + 1, 4, 2), jnp.uint32),
        launch=reference.Launch(
            write_offsets=jnp.arange(0, num_tokens + 1, chunk, dtype=jnp.int32),
            seed_slot_indices=jnp.full((batch,), -1, jnp.int32),
            num_valid_reqs=jnp.array([batch], jnp.int32),
            input_ids=jnp.asarray(rng.integers(0, 32000, num_tokens), jnp.int32),
            positions=jnp.tile(jnp.arange(chunk, dtype=jnp.int32), batch),
            out_cache_loc=jnp.arange(1, num_tokens + 1, dtype=jnp.int32),
            enable_chain_position_assert=jnp.ones((1,), jnp.int32),
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--block", type=int, nargs="+", default=[reference.chain_block()])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    inputs = _inputs(args.batch, args.chunk)
    print(f"backend={jax.default_backend()} jax={jax.__version__} bs={args.batch} chunk={args.chunk}")
    print(f"{'block':>5} {'first call s':>12} {'median ms':>10}")
    for block in args.block:
        reference.CHAIN_BLOCK = reference.CPU_CHAIN_BLOCK = block  # whichever the platform reads
        jax.clear_caches()  # the block size is a module constant, not a jit argument
        fn = jax.jit(reference.write_chain)
        start = time.perf_counter()
        jax.block_until_ready(fn(**inputs))
        first = time.perf_counter() - start
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            jax.block_until_ready(fn(**inputs))
            times.append(time.perf_counter() - start)
        print(f"{block:>5} {first:>12.2f} {statistics.median(times) * 1e3:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
