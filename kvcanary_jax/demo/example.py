"""A 30-line tour of the core ops: write a chain, verify it clean, tamper one record, print the report."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import kvcanary_jax as kc


def run_example() -> int:
    """Writes tokens 101..505 of one request (pool row 1; row 0 is padding) into slots 1..5, verifies, tampers slot 3, verifies again.

    Returns the number of violations the tampered verify found (the clean one must find none).
    """
    config = kc.CanaryConfig(mode="raise", backend="xla")
    state = kc.CanaryDeviceState.allocate(config=config)
    buf = kc.allocate_canary_buffer(8)
    req_to_token = jnp.zeros((2, 8), jnp.int32).at[1, :5].set(jnp.arange(1, 6, dtype=jnp.int32))

    def plans(prefix_len: int, extend_len: int):
        return kc.build_plans(
            jnp.array([1], jnp.int32),
            jnp.array([prefix_len], jnp.int32),
            jnp.array([extend_len], jnp.int32),
            req_to_token,
            verify_capacity=16,
            write_req_capacity=1,
        )

    _, write_plan = plans(0, 5)
    tokens, positions = jnp.array([101, 202, 303, 404, 505], jnp.int32), jnp.arange(5, dtype=jnp.int32)
    write = jax.jit(kc.canary_write, static_argnames=("tag", "backend"), donate_argnums=(1,))
    buf, state = write(
        state,
        buf,
        write_plan,
        tokens,
        positions,
        req_to_token[1, :5],
        tag=kc.CanaryLaunchTag.HEAD_K_FULL,
        backend="xla",
    )
    print("PREV_HASH of slots 1..5:", [f"{int(h) & (2**64 - 1):016X}" for h in kc.records_as_int64(buf)[1:6, 2]])

    verify = jax.jit(kc.canary_verify, static_argnames=("tag", "backend"))
    verify_plan, _ = plans(5, 0)
    clean = kc.read_violations(
        verify(state, buf, verify_plan, tag=kc.CanaryLaunchTag.TAIL_K_FULL, backend="xla").violation_log
    )
    print(f"clean verify: {clean.write_index} violations")

    tampered = buf.at[3, 0].set(jnp.array([999, 0], jnp.uint32))  # slot 3's TOKEN: 303 -> 999
    report = kc.read_violations(
        verify(state, tampered, verify_plan, tag=kc.CanaryLaunchTag.TAIL_K_FULL, backend="xla").violation_log
    )
    print(f"tampered verify (slot 3 token 303 -> 999): {report.write_index} violation(s)")
    for message in report.format():
        print(message)
    return report.write_index if clean.write_index == 0 else -1
