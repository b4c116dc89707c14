"""Host callbacks of one ``interpret_tpu`` step: calls and arguments, in all and by the kernel line that made them.

    python benchmarks/count_interpret_callbacks.py [readme|demo] [--top 25]

TPU interpret mode turns every SMEM/VMEM access, DMA start and DMA wait of a Mosaic kernel (and each launch's
buffer set-up) into one ``io_callback``; on CPU its cost grows with the callback's arguments (about 70 us an
argument on the 2-core CI machine), and the count does not depend on the machine's load. Counts the second step
of ``bench_cpu_cost``'s wrapped step (the first compiles). Reads jax internals (the interpreter's
``callback.io_callback``), checked on jax 0.10.2 only.
"""

from __future__ import annotations

import argparse
import collections
import functools
import pathlib
import sys
import time

import jax
from jax._src import source_info_util
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_cpu_cost  # noqa: E402

CALLS: collections.Counter = collections.Counter()
ARGS: collections.Counter = collections.Counter()


def _where(fn) -> str:
    """The callback's kind, and the kernel line that made it (when the interpreter passed its source info)."""
    name = getattr(getattr(fn, "func", fn), "__name__", str(fn))
    info = fn.keywords.get("source_info") if isinstance(fn, functools.partial) else None
    frame = source_info_util.user_frame(info.traceback) if info is not None else None
    return name if frame is None else f"{name} {'/'.join(frame.file_name.split('/')[-2:])}:{frame.start_line}"


def _counting(io_callback):
    def wrapped(fn, result_shape, *args, **kwargs):
        key, num_args = _where(fn), len(jax.tree.leaves(args))

        def counted(*a, **k):
            CALLS[key] += 1
            ARGS[key] += num_args
            return fn(*a, **k)

        return io_callback(counted, result_shape, *args, **kwargs)

    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="?", default="readme", choices=("readme", "demo"))
    parser.add_argument("--top", type=int, default=25, help="lines listed, most arguments first")
    args = parser.parse_args()
    interpreter.callback.io_callback = _counting(interpreter.callback.io_callback)
    build = bench_cpu_cost.readme_step if args.shape == "readme" else bench_cpu_cost.demo_step
    fn, step_args, feed = build("interpret_tpu", True)
    out = fn(*step_args)
    jax.block_until_ready(out)
    step_args = feed(step_args, out)
    CALLS.clear()
    ARGS.clear()
    start = time.perf_counter()
    jax.block_until_ready(fn(*step_args))
    elapsed = time.perf_counter() - start
    print(f"{args.shape}: {sum(CALLS.values())} callbacks, {sum(ARGS.values())} arguments ({elapsed * 1e3:.0f} ms)")
    for key, n in ARGS.most_common(args.top):
        print(f"{n:7d} arguments {CALLS[key]:6d} calls  {key}")


if __name__ == "__main__":
    main()
