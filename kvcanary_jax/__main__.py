"""Command line: ``python -m kvcanary_jax demo`` (the fault-injection demo), ``example``, ``serve sglang-jax ...`` (the
engine's server with the canary on) or ``tiny-model DIR`` (a tiny Llama to serve)."""

from __future__ import annotations

import argparse
import io
import json
import sys

from pallas_kernels.backend import BACKENDS


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["serve", "sglang-jax"]:
        from kvcanary_jax.integrations import sglang_serve_args, sglang_server  # every other argument is sglang-jax's

        if {"-h", "--help"} & set(argv[2:3]):
            sglang_serve_args.canary_parser().print_help()
            print("\nEvery other argument is sglang-jax's: python -m sgl_jax.launch_server --help")
            return 0
        return sglang_server.main(argv[2:])
    parser = argparse.ArgumentParser(prog="python -m kvcanary_jax", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="run a tiny paged-KV model with the canary: a clean run, then every fault kind; prints a table"
    )
    demo.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    demo.add_argument("--seed", type=int, default=0, help="seeds the weights, the workload and the fault targets")
    demo.add_argument("--clean-steps", type=int, default=300, help="steps of the clean (no fault) run")
    demo.add_argument(
        "--devices", type=int, default=None, metavar="N",
        help="run sharded over N devices, a (dp, tp) mesh (on CPU: N fake devices); faults hit one device",
    )  # fmt: skip
    demo.add_argument(
        "--processes", type=int, default=None, metavar="P",
        help="with --devices D: run the sharded demo over P local jax.distributed processes of D CPU devices each",
    )  # fmt: skip
    demo.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)  # set for each child process
    demo.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    demo.add_argument(
        "--backend", default="auto", choices=BACKENDS,
        help="the canary's kernels: auto (Triton on GPU, Mosaic on TPU, else xla), xla, pallas, interpret (Triton, "
        "interpreted) or interpret_tpu (Mosaic, interpreted; slow)",
    )  # fmt: skip
    demo.add_argument(
        "--engine", default="toy", choices=("toy", "sglang-jax"),
        help="toy: the built-in paged-KV model; sglang-jax: a tiny random Llama on the real engine (needs the "
        "sglang-jax extra)",
    )  # fmt: skip
    demo.add_argument(
        "--tp", type=int, default=1, metavar="T",
        help="with --engine sglang-jax: split the KV heads over T CPU devices (tensor parallelism)",
    )  # fmt: skip
    demo.add_argument(
        "--dp", type=int, default=1, metavar="D",
        help="with --engine sglang-jax: D data-parallel ranks (each of --tp devices), each numbering its own KV slots",
    )  # fmt: skip
    demo.add_argument(
        "--hicache", action="store_true",
        help="with --engine sglang-jax: also the HiCache transfer faults (host-memory backup and load-back)",
    )  # fmt: skip
    commands.add_parser("example", help="write, verify and tamper one request's chain, printing the report")
    serve = commands.add_parser(
        "serve", help="serve sglang-jax (its launch_server arguments, unchanged) with the canary in its scheduler: "
        "serve sglang-jax --model-path DIR ... [--canary-mode off|log|raise] [--canary-real-kv none|partial|all] "
        "[--canary-sweep-interval N] [--canary-inject KIND[:PROB]]",
    )  # fmt: skip
    serve.add_argument("engine", choices=("sglang-jax",))
    tiny = commands.add_parser(
        "tiny-model", help="write a tiny random Llama (config, weights, local tokenizer) to DIR, or with --size a "
        "larger Llama-shaped config for benchmarks",
    )  # fmt: skip
    tiny.add_argument("dir", help="the model directory to write")
    tiny.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    tiny.add_argument(
        "--size", default="tiny", choices=("tiny", "1b", "8b"),
        help="tiny: a 2-layer Llama with random weights (runs on CPU); 1b / 8b: Llama-shaped configs (8b: "
        "Llama-3-8B's), config and tokenizer only: serve them with --load-format dummy",
    )  # fmt: skip
    tiny.add_argument("--arch", default="llama", help="the model family (tiny, random weights): llama (default), "
                      "or another of kvcanary_jax.integrations.tiny_models.ARCHS")  # fmt: skip
    tiny.add_argument(
        "--draft", default=None, choices=("standalone", "eagle3", "dflash"),
        help="a draft model for the tiny Llama (sglang-jax's --speculative-draft-model-path): standalone (a 1-layer "
        "Llama, random weights), eagle3 (a LlamaForCausalLMEagle3 head) or dflash (a DFlash draft), the last two "
        "config and tokenizer only (--load-format dummy)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.command == "tiny-model":
        from kvcanary_jax.integrations import tiny_llama, tiny_models

        if args.draft is not None and (args.size, args.arch) != ("tiny", "llama"):
            parser.error("--draft writes a draft for the tiny Llama: drop --size and --arch")
        try:
            if args.draft is not None:
                print(tiny_llama.write_tiny_model(args.dir, seed=args.seed, draft=args.draft))
            else:
                print(tiny_models.write_arch(args.dir, arch=args.arch, seed=args.seed, size=args.size))
        except ValueError as err:
            parser.error(str(err))
        return 0
    if args.command == "demo" and args.engine == "toy" and (args.tp, args.dp) != (1, 1):
        print("--tp / --dp are for --engine sglang-jax; the toy engine's sharded demo takes --devices N")
        return 2
    if args.command == "demo" and args.hicache and args.engine != "sglang-jax":
        print("--hicache needs --engine sglang-jax (HiCache is the engine's host-memory KV tier)")
        return 2
    if args.command == "demo" and args.engine == "sglang-jax":
        return _engine_demo(args)
    if args.command == "demo" and args.processes is not None:
        return _processes_demo(args)
    if args.command == "demo" and args.devices is not None:
        from kvcanary_jax.demo import sharded, sharded_faults

        sharded.use_fake_cpu_devices(args.devices)  # before anything initialises jax
        return sharded_faults.run_sharded_demo(
            devices=args.devices, seed=args.seed, clean_steps=args.clean_steps, as_json=args.json, backend=args.backend
        )
    if args.command == "demo":
        from kvcanary_jax.demo import cli  # imports the demo model only when asked for

        return cli.run_demo(seed=args.seed, clean_steps=args.clean_steps, as_json=args.json, backend=args.backend)
    from kvcanary_jax.demo import example

    return 0 if example.run_example() > 0 else 1


def _processes_demo(args: argparse.Namespace) -> int:
    """The sharded fault table over ``--processes`` local processes: the parent, or one child (``--process-id``)."""
    from kvcanary_jax.demo import multiprocess

    if args.devices is None or args.engine != "toy":
        print("--processes P needs --devices D (CPU devices per process) and the toy engine")
        return 2
    options = {"seed": args.seed, "clean_steps": args.clean_steps, "backend": args.backend}
    if args.process_id is not None:
        return multiprocess.run_process(
            process_id=args.process_id, processes=args.processes, coordinator=args.coordinator, **options
        )
    return multiprocess.run_multiprocess_demo(
        processes=args.processes, devices=args.devices, as_json=args.json, out=sys.stdout, **options
    )


def _engine_demo(args: argparse.Namespace) -> int:
    """The fault table over sglang-jax, or a one-line hint when the extra is not installed."""
    from kvcanary_jax.integrations import sglang_jax

    if args.devices is not None or args.backend not in ("auto", "xla"):
        print("--engine sglang-jax runs with the xla backend on --tp x --dp devices (the engine's KV is explicitly "
              "sharded); --devices is for the toy engine")  # fmt: skip
        return 2
    if args.tp < 1 or args.dp < 1:
        print(f"--tp and --dp must be >= 1; got --tp {args.tp} --dp {args.dp}")
        return 2
    if args.hicache and args.tp * args.dp > 1:
        print("--hicache runs on one device; drop --tp / --dp")
        return 2
    if args.tp * args.dp > 1:
        from kvcanary_jax.demo import sharded

        sharded.use_fake_cpu_devices(args.tp * args.dp)  # before anything initialises jax
    try:
        sglang_jax.require_sglang_jax()
    except ImportError as err:
        print(err)
        return 1
    from kvcanary_jax.demo import sglang_faults

    engine = {"seed": args.seed, "tp": args.tp, "dp": args.dp}
    if not args.hicache:
        return sglang_faults.run_demo(**engine, as_json=args.json)
    from kvcanary_jax.demo import sglang_hicache

    if not args.json:
        status = sglang_faults.run_demo(**engine)
        print()
        return status | sglang_hicache.run_demo(seed=args.seed)
    faults, hicache = io.StringIO(), io.StringIO()
    status = sglang_faults.run_demo(**engine, as_json=True, out=faults)
    status |= sglang_hicache.run_demo(seed=args.seed, as_json=True, out=hicache)
    print(json.dumps({"ok": not status, "faults": json.loads(faults.getvalue()),
                      "hicache": json.loads(hicache.getvalue())}, indent=2))  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main())
