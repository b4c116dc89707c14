"""``python -m kvcanary_jax demo --devices N``: a clean run, then each fault injected on one device, as a table.

Every fault of the single-device demo is injected through its :class:`~kvcanary_jax.demo.faults.Injector` on the
mesh's last device (or, for a fault in the batch, into its data shard), plus ``shard_chain``, one device's chain
record. Each must be reported by exactly the devices that hold it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np

import kvcanary_jax as kc
from kvcanary_jax import CanaryLaunchTag, FailReason, KvCanaryViolationError, PoolKind, testing
from kvcanary_jax.demo import faults, model
from kvcanary_jax.demo.sharded import ShardedDemo, mesh_layout

Coords = tuple[int, ...]  # mesh coordinates
_INJECT_AT, _MAX_FAULT_STEPS = 10, 40
# Faults in a data shard's batch, not in one head's KV: every TP shard of that data shard sees them.
_IN_BATCH = (testing.FaultKind.REQ_TO_TOKEN, testing.FaultKind.TOKEN_SWAP)
_COLUMNS = ("fault", "injected on", "at step", "reported by", "at step", "launch tag", "fail reasons", "result")


@dataclasses.dataclass(frozen=True)
class ShardedRunResult:
    """One run: clean (``fault == "none"``) or one fault, and what the monitor read first.

    ``reported_by`` lists the devices that reported; ``launch_tag`` is the first violation's, ``fail_reasons`` the
    union over the first detecting step.
    """

    fault: str
    injected_on: str | None
    injected_step: int | None
    reported_by: tuple[str, ...]
    detected_step: int | None
    launch_tag: str | None
    fail_reasons: str | None
    steps: int
    ok: bool
    note: str = ""


class _DeviceView:
    """What :class:`faults.Injector` reads and edits, for one device: its data shard's scheduler and its KV head."""

    def __init__(self, demo: ShardedDemo, coords: Coords):
        self.demo, self.data, self.head = demo, coords[0], coords[1]
        self.monitor, self.scheduler = demo.monitor, demo.schedulers[self.data]
        self.layout, self.sched_config = demo.base.layout, demo.base.sched_config

    @property
    def kv_cache(self) -> model.KvCache:
        """This device's KV: every layer's ``[pages, page_size, 1, head_dim]`` slice."""
        return jax.tree.map(lambda x: x[self.data, :, :, self.head : self.head + 1], self.demo.kv_cache)

    @kv_cache.setter
    def kv_cache(self, mine: model.KvCache) -> None:
        def put(full: jax.Array, part: jax.Array) -> jax.Array:
            # Back on the step's sharding: another input sharding would recompile the step.
            return jax.device_put(full.at[self.data, :, :, self.head : self.head + 1].set(part), full.sharding)

        self.demo.kv_cache = jax.tree.map(put, self.demo.kv_cache, mine)


class _Hooks:
    """Injects one fault on ``target`` at (or after) step ``_INJECT_AT``: a :class:`testing.FaultKind` through the
    single-device demo's :class:`faults.Injector` on a :class:`_DeviceView`, or ``"shard_chain"``.
    """

    def __init__(self, demo: ShardedDemo, target: Coords, fault, group: PoolKind, seed: int):
        self.demo, self.target, self.fault = demo, target, fault
        self.view = _DeviceView(demo, target)
        rng = np.random.default_rng(seed + 1)
        self.injector = faults.Injector(fault, group, _INJECT_AT, rng) if fault != "shard_chain" else None
        self._chain_step: int | None = None

    @property
    def injected_step(self) -> int | None:
        return self.injector.injected_step if self.injector else self._chain_step

    def before_forward(self, batches: list) -> None:
        if self.injector and (new := self.injector.before_forward(self.view, batches[self.target[0]])) is not None:
            batches[self.target[0]] = new

    def after_commit(self, batches: list) -> None:
        if self.injector:
            self.injector.after_commit(self.view, batches[self.target[0]])
        elif self._chain_step is None and self.demo.monitor.step + 1 >= _INJECT_AT and self._corrupt_chain_seed():
            self._chain_step = self.demo.monitor.step + 1

    def _corrupt_chain_seed(self) -> bool:
        """Flips a PREV_HASH bit of the target's K TAIL record of a decoding request's last cached slot.

        The target's next TAIL verify reports CHAIN, and the record it then chains differs from its TP peers'
        (shard_chain). The target is the last TP index, which the tie rule (lowest index wins) never takes as the
        consensus, so with two TP shards the shard_chain row still comes from the target.
        """
        s = self.view.scheduler
        decoding = [r for r in s.running if not r.in_prefill]
        if not decoding:
            return False
        slot = int(s.req_pool.req_to_token[decoding[0].pool_row, decoding[0].kv_len - 1])
        state = self.demo.canary_state
        k_tail = state.full.k_tail
        index = (*self.target, slot, 2, 0)  # PREV_HASH (field 2), low word
        k_tail = jax.device_put(k_tail.at[index].set(k_tail[index] ^ jnp.uint32(1)), k_tail.sharding)
        self.demo.canary_state = dataclasses.replace(state, full=dataclasses.replace(state.full, k_tail=k_tail))
        return True


def _expected(fault, group: PoolKind, mesh_layout: kc.MeshLayout, target: Coords):
    """``(tag, bits, steps_after, devices)`` that must report ``fault`` first (see ``testing.expected_detection``)."""
    if fault == "shard_chain":  # the device's own verify reports first; its next record also breaks TP consensus
        return CanaryLaunchTag.TAIL_K_FULL, FailReason.VERIFY_CHAIN_HASH_MISMATCH, 1, {target}
    tag, bits, after = testing.expected_detection(fault, group)
    devices = {c for c, _ in mesh_layout.devices() if c[0] == target[0]} if fault in _IN_BATCH else {target}
    return tag, bits, after, devices


def run(
    fault=None,
    *,
    mesh_layout: kc.MeshLayout,
    group: PoolKind = PoolKind.FULL,
    seed: int = 0,
    max_steps: int = _MAX_FAULT_STEPS,
    backend: str = "auto",
) -> ShardedRunResult:
    """Runs the sharded demo clean (``fault`` None) or with one fault on the mesh's last device.

    A fault run stops once the monitor raises (raise mode) or after ``max_steps``. The first violation must come
    from the launch, with a bit, and on time as :func:`kvcanary_jax.testing.expected_detection` says, and exactly
    the devices holding the fault may report.

    Args:
      fault: None, a :class:`testing.FaultKind` (injected as in the single-device demo), or ``"shard_chain"``.
      mesh_layout: a ``(dp, tp)`` layout from :func:`mesh_layout`.
      group: the pool group a KV fault hits.
      max_steps: steps of a clean run; the most a fault run may take.
      backend: the canary's backend.
    """
    demo = ShardedDemo.build(mesh_layout, seed, backend)
    target = tuple(n - 1 for n in mesh_layout.shape)
    hooks = _Hooks(demo, target, fault, group, seed) if fault is not None else None
    try:
        for _ in range(max_steps):
            demo.step(hooks)
            if hooks is not None and hooks.injected_step is not None and demo.monitor.observed:
                break
        demo.monitor.final_check(demo.canary_state)
    except KvCanaryViolationError:
        pass  # raise mode: monitor.observed holds what was read
    observed = demo.monitor.observed
    first = observed[0].observed if observed else None
    # Every reason of the first detecting step, device-major (a device's SHARD_CHAIN rows follow its verify rows).
    reasons = dict.fromkeys(
        r for o in observed if o.observed.step == first.step for r in o.observed.violation.reason_labels
    )
    injected = hooks.injected_step if hooks else None
    problems = _problems(fault, group, mesh_layout, target, injected, first, {o.device for o in observed}, reasons)
    if fault is None:
        name, injected_on = "none", None
    else:
        name = fault if fault == "shard_chain" else f"{fault.value}/{group.name}"
        injected_on = f"dp={target[0]},tp=*" if fault in _IN_BATCH else mesh_layout.label(target)
    return ShardedRunResult(
        fault=name,
        injected_on=injected_on,
        injected_step=injected,
        reported_by=tuple(mesh_layout.label(c) for c in sorted({o.device for o in observed})),
        detected_step=first.step if first else None,
        launch_tag=first.violation.tag_label if first else None,
        fail_reasons="+".join(reasons) if first else None,
        steps=demo.monitor.step,
        ok=not problems,
        note="; ".join(problems),
    )


def _problems(
    fault,
    group: PoolKind,
    mesh_layout: kc.MeshLayout,
    target: Coords,
    injected: int | None,
    first: kc.ObservedViolation | None,
    reporters: set[Coords],
    reasons: dict[str, None],
) -> list[str]:
    """What went wrong in a run, as in the single-device demo, plus which devices reported."""
    if fault is None:
        return ["false positive in the clean run"] if first is not None else []
    if injected is None:
        return ["no target to inject into"]
    if first is None:
        return ["fault went undetected"]
    tag, bits, after, devices = _expected(fault, group, mesh_layout, target)
    late = first.step - injected > (faults.DEMO_CONFIG.sweep_interval if fault is testing.FaultKind.IDLE_CACHE_KV
                                    else after)  # fmt: skip
    checks = {
        "fired before the injection": first.step < injected,
        f"expected {tag.name}": first.violation.launch_tag != tag,
        f"expected a bit of {bits!r}": not first.violation.fail_reason & bits,
        "detected late": late,
        "expected shard_chain rows too": fault == "shard_chain" and "shard_chain" not in reasons,
        f"expected reports from {sorted(mesh_layout.label(c) for c in devices)} only": reporters != devices,
    }
    return [k for k, bad in checks.items() if bad]


def format_table(results: list[ShardedRunResult]) -> str:
    """The results as a fixed-width text table."""
    dash = lambda x: "-" if x is None else str(x)  # noqa: E731
    rows = [_COLUMNS] + [
        (r.fault, dash(r.injected_on), dash(r.injected_step), " ".join(r.reported_by) or "-", dash(r.detected_step),
         dash(r.launch_tag), dash(r.fail_reasons), "ok" if r.ok else f"FAIL: {r.note}")
        for r in results
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fault_table(
    *, devices: int, seed: int = 0, clean_steps: int = 300, backend: str = "auto"
) -> tuple[kc.MeshLayout, list[ShardedRunResult]]:
    """The mesh of ``devices`` devices (all processes' under ``jax.distributed``), and the clean run and every fault.

    On CPU, call :func:`kvcanary_jax.demo.sharded.use_fake_cpu_devices` first (before jax initialises).
    """
    if not isinstance(devices, int) or not 1 <= devices <= len(jax.devices()):
        raise ValueError(
            f"--devices must be between 1 and the {len(jax.devices())} {jax.devices()[0].platform} device(s) jax "
            f"has; got {devices=}. On CPU, use_fake_cpu_devices(N) makes N devices if it runs before jax initialises."
        )
    lay = mesh_layout(devices)
    runs = [(None, PoolKind.FULL), *faults.FAULT_RUNS]  # the clean run and the single-device demo's faults
    if lay.mesh.shape["tp"] > 1:
        runs.append(("shard_chain", PoolKind.FULL))
    max_steps = lambda f: clean_steps if f is None else _MAX_FAULT_STEPS  # noqa: E731
    return lay, [run(f, mesh_layout=lay, group=g, seed=seed, max_steps=max_steps(f), backend=backend) for f, g in runs]


def write_results(
    results: list[ShardedRunResult],
    *,
    mesh: dict[str, int],
    where: str,
    wall_s: float,
    as_json: bool,
    out: TextIO,
    processes: int = 1,
) -> int:
    """Prints the table (or JSON) of a fault table run on ``mesh``; ``where`` names the devices. 0 if all went well."""
    ok = all(r.ok for r in results)
    if as_json:
        payload = {"ok": ok, "mesh": mesh, "processes": processes, "wall_s": round(wall_s, 1),
                   "runs": [dataclasses.asdict(r) for r in results]}  # fmt: skip
        out.write(json.dumps(payload, indent=2) + "\n")
    else:
        axes = ", ".join(f"{a}={n}" for a, n in mesh.items())
        out.write(f"mesh: {axes} ({where}); faults injected on the last device\n\n")
        out.write(format_table(results) + "\n")
        verdict = (
            "all faults reported by the right devices, no false positives" if ok else "FAILED: see the result column"
        )
        out.write(f"\n{verdict} ({wall_s:.0f} s)\n")
    return 0 if ok else 1


def run_sharded_demo(
    *,
    devices: int,
    seed: int = 0,
    clean_steps: int = 300,
    as_json: bool = False,
    backend: str = "auto",
    out: TextIO = sys.stdout,
) -> int:
    """Runs the clean run and every fault on ``devices`` devices; prints a table (or JSON). 0 if all went as expected.

    On CPU, call :func:`kvcanary_jax.demo.sharded.use_fake_cpu_devices` first (before jax initialises).
    """
    started = time.perf_counter()
    lay, results = fault_table(devices=devices, seed=seed, clean_steps=clean_steps, backend=backend)
    where = f"{devices} {jax.devices()[0].platform} devices"
    wall_s = time.perf_counter() - started
    return write_results(results, mesh=dict(lay.mesh.shape), where=where, wall_s=wall_s, as_json=as_json, out=out)
