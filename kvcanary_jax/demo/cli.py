"""``python -m kvcanary_jax demo``: a clean run, then every fault kind in turn, as a table (or ``--json``)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import TextIO

from kvcanary_jax.demo import faults

# Faults on KV bytes are run against both groups; the other two are always caught by the FULL group's HEAD.
_COLUMNS = ("fault", "group", "injected at step", "detected at step", "launch tag", "fail reason", "result")


class _Status:
    """A one-line live status on a terminal's stderr; silent when stderr is not a terminal."""

    def __init__(self, stream: TextIO):
        self.stream, self.live = stream, stream.isatty()

    def show(self, text: str) -> None:
        if self.live:
            self.stream.write("\r\x1b[2K" + text)
            self.stream.flush()

    def done(self) -> None:
        self.show("")


def _row(r: faults.RunResult) -> tuple[str, ...]:
    dash = lambda x: "-" if x is None else str(x)  # noqa: E731
    result = "ok" if r.ok else f"FAIL: {r.note}"
    if r.fault == "none":
        defect = r.note.startswith("engine defect")  # sglang-jax's own, found by the canary (see sglang_faults)
        outcome = "-" if not r.ok else f"{r.steps} steps, " + ("an engine defect (below)" if defect else "0 violations")
        return ("none (clean run)", "-", "-", "-", "-", outcome, result)
    return (
        r.fault,
        r.group,
        dash(r.injected_step),
        dash(r.detected_step),
        dash(r.launch_tag),
        dash(r.fail_reason),
        result,
    )


def format_table(results: list[faults.RunResult]) -> str:
    """The results as a fixed-width text table."""
    rows = [_COLUMNS] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_demo(
    *, seed: int = 0, clean_steps: int = 300, as_json: bool = False, backend: str = "auto", out: TextIO | None = None
) -> int:
    """Runs the clean run and every fault; prints the table (or JSON) to ``out`` (default stdout).

    Args:
      backend: the canary's backend (``"interpret_tpu"`` runs the Mosaic kernels interpreted: slow, but any machine).

    Returns 0 if every run was as expected: the clean run silent, every fault caught by the expected launch.
    """
    out = out or sys.stdout
    config = dataclasses.replace(faults.DEMO_CONFIG, backend=backend)
    status = _Status(sys.stderr)
    started = time.perf_counter()

    def progress(label: str, total: int):
        return lambda step: status.show(
            f"[kvcanary demo] {label}: step {step}/{total}  ({time.perf_counter() - started:.0f} s)"
        )

    status.show("[kvcanary demo] compiling the jitted step (first step) ...")
    results = [
        faults.run(None, seed=seed, max_steps=clean_steps, config=config, on_step=progress("clean run", clean_steps))
    ]
    for kind, group in faults.FAULT_RUNS:
        label = f"{kind.value}/{group.name}"
        results.append(faults.run(kind, group=group, seed=seed, config=config, on_step=progress(label, 60)))
    status.done()
    ok = all(r.ok for r in results)
    if as_json:
        payload = {
            "ok": ok,
            "backend": backend,
            "wall_s": round(time.perf_counter() - started, 1),
            "runs": [dataclasses.asdict(r) for r in results],
        }
        out.write(json.dumps(payload, indent=2) + "\n")
    else:
        out.write(format_table(results) + "\n")
        verdict = "all faults detected, no false positives" if ok else "FAILED: see the result column"
        out.write(f"\n{verdict} ({time.perf_counter() - started:.0f} s)\n")
    return 0 if ok else 1
