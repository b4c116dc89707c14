"""``serve sglang-jax``'s command line: the ``--canary-*`` options split from the engine's own, checked, and what the
served canary refuses at startup, by name, before anything serves."""

from __future__ import annotations

import argparse
import dataclasses
import os

import kvcanary_jax as kc
from kvcanary_jax.integrations import sglang_drills
from kvcanary_jax.integrations._sglang_refuse import speculative_refusal


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """The ``--canary-*`` options (see :func:`canary_parser`) and the pid to signal on a raise-mode stop."""

    mode: str = "log"
    real_kv: str = "partial"
    sweep_interval: int = 16
    inject: str | None = None
    inject_seed: int = 0
    token_asserts: bool = True
    native_swa: bool = False
    server_pid: int = 0

    def config(self) -> kc.CanaryConfig:
        return kc.CanaryConfig(
            mode="log" if self.mode == "raise" else self.mode,  # raise: this module stops the engine itself
            real_kv_hash_mode=self.real_kv,
            sweep_interval=self.sweep_interval,
            enable_write_input_assert=self.token_asserts,
            enable_verify_token_assert=self.token_asserts,
        )


def canary_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvcanary_jax serve sglang-jax", add_help=False,
                                usage="%(prog)s <sglang-jax launch_server arguments> [--canary-* options]")  # fmt: skip
    p.add_argument("--canary-mode", default="log", choices=("off", "log", "raise"),
                   help="log: each violation is logged and counted, serving goes on; raise: the first stops the "
                   "server (exit code 3); off: no canary")  # fmt: skip
    p.add_argument("--canary-real-kv", default="partial", choices=("none", "partial", "all"),
                   help="hash the real K/V bytes of each slot: none (records only), partial (a few bytes per slot), "
                   "all (every byte)")  # fmt: skip
    p.add_argument("--canary-sweep-interval", type=int, default=16, metavar="N",
                   help="verify every slot the radix cache holds every N steps (0: never)")  # fmt: skip
    p.add_argument("--canary-no-token-asserts", action="store_true",
                   help="skip the write-input and verify-token asserts (no host token table per step)")  # fmt: skip
    p.add_argument("--canary-inject", default=os.environ.get("KVCANARY_INJECT"), metavar="KIND[:PROB]",
                   help=f"fault drill, one of {', '.join(sglang_drills.KINDS)}, fired with PROB per step (default "
                   "0.1; env KVCANARY_INJECT)")  # fmt: skip
    p.add_argument("--canary-inject-seed", type=int, default=0, help="seed of the drill's choices")
    p.add_argument("--canary-native-swa", action="store_true",
                   help="patch the engine's native attention (CPU / GPU) to address a sliding-window model's "
                   "SWAKVPool, which sglang-jax 0.1.0rc0 does on TPU only (kvcanary_jax.integrations."
                   "sglang_native_swa); with the canary on or off")  # fmt: skip
    return p


def split_args(argv: list[str]) -> tuple[ServeSettings, list[str]]:
    """``(settings, the rest)``: the ``--canary-*`` options parsed, every other argument untouched, in order."""
    # an option's value follows it as the next argument unless written --opt=value
    canary, rest, i = [], [], 0
    takes_value = {"--canary-mode", "--canary-real-kv", "--canary-sweep-interval", "--canary-inject",
                   "--canary-inject-seed"}  # fmt: skip
    while i < len(argv):
        a = argv[i]
        if a.startswith("--canary-"):
            canary.append(a)
            if a in takes_value and i + 1 < len(argv):
                canary.append(argv[i + 1])
                i += 1
        else:
            rest.append(a)
        i += 1
    ns = canary_parser().parse_args(canary)
    if ns.canary_sweep_interval < 0:
        raise ValueError(f"--canary-sweep-interval must be >= 0; got {ns.canary_sweep_interval}")
    if ns.canary_inject:
        spec = sglang_drills.DrillSpec.parse(ns.canary_inject)
        if ns.canary_mode == "off":
            raise ValueError("--canary-inject needs the canary on (--canary-mode log or raise)")
        if spec.kind in ("live_kv", "idle_cache_kv") and ns.canary_real_kv == "none":
            raise ValueError(f"--canary-inject {spec.kind} flips KV bytes: it needs --canary-real-kv partial or all")
        if spec.kind == "idle_cache_kv" and ns.canary_sweep_interval == 0:
            raise ValueError("--canary-inject idle_cache_kv is found by the sweep: set --canary-sweep-interval > 0")
        if spec.kind == "token_swap" and ns.canary_no_token_asserts:
            raise ValueError("--canary-inject token_swap is found by the token asserts: drop --canary-no-token-asserts")
    settings = ServeSettings(mode=ns.canary_mode, real_kv=ns.canary_real_kv, sweep_interval=ns.canary_sweep_interval,
                             inject=ns.canary_inject, inject_seed=ns.canary_inject_seed,
                             token_asserts=not ns.canary_no_token_asserts, native_swa=ns.canary_native_swa,
                             server_pid=os.getpid())  # fmt: skip
    return settings, rest


def refuse_unmapped(server_args) -> None:
    """At startup, before anything serves: refuses by name what the canary's mapping does not cover."""
    problems = []
    speculative = speculative_refusal(server_args.speculative_algorithm)
    if speculative is not None:
        problems.append(speculative)
    tp, dp = int(getattr(server_args, "tp_size", 1) or 1), int(server_args.dp_size or 1)
    if tp > 1 or dp > 1:
        problems.append(f"tensor or data parallelism (--tp-size {tp} --dp-size {dp}: only the in-process wrap maps "
                        "them, without the overlap scheduler)")  # fmt: skip
    if getattr(server_args, "hicache_storage", "disable") != "disable" and not server_args.disable_overlap_schedule:
        problems.append(f"HiCache under the overlap scheduler (--hicache-storage {server_args.hicache_storage}: add "
                        "--disable-overlap-schedule, under which records are carried with the host pages)")  # fmt: skip
    if getattr(server_args, "disaggregation_mode", "null") != "null":
        problems.append(f"PD disaggregation (--disaggregation-mode {server_args.disaggregation_mode})")
    if getattr(server_args, "multimodal", False):
        problems.append("the multimodal server")
    if problems:
        raise NotImplementedError("kvcanary serve does not map " + "; ".join(problems))
