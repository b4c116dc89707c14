"""A whole wrapped decode step (``KvCanary`` HEAD, a forward, TAIL) exports for TPU and for CUDA from a CPU host.

With ``backend="pallas"`` the canary's launches lower to the platform's own kernels, chosen by the platform lowered
for: Mosaic custom calls for TPU, Triton calls for CUDA, and no XLA while loop anywhere in the step.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import export

import kvcanary_jax as kc
from pallas_kernels import compat

S = jax.ShapeDtypeStruct
NUM_SLOTS, PAGE, ROWS, CONTEXT, BATCH, TOKENS = 256, 16, 8, 64, 4, 4
CANARY = kc.KvCanary(
    kc.CanaryConfig(real_kv_hash_mode="partial", enable_write_input_assert=True, backend="pallas"),
    kc.CanaryPool(num_slots=NUM_SLOTS, page_size=PAGE),
)
# The kernels of a step. On TPU, the single ops' Mosaic kernels: verify, and a chain walk and a record store per
# write (launches of one shape share one lowered function, so each appears once or twice, not once per launch). On
# GPU, the fused phase's two Triton kernels per phase.
MOSAIC = ("kvcanary_verify_mosaic", "kvcanary_write_chain_mosaic", "kvcanary_write_store_mosaic")
TRITON = ("kvcanary_phase_check", "kvcanary_phase_ring_store")


def _step(k, v, state, batch):
    state = CANARY.before_forward(state, batch)
    state, k, v = kc.fence(state, k, v)
    loc = jnp.maximum(batch.out_cache_loc, 0)
    k = k.at[loc // PAGE, loc % PAGE].add(1)  # stands in for the forward's KV writes
    v = v.at[loc // PAGE, loc % PAGE].add(2)
    state, k, v = kc.fence(state, k, v)
    return k, v, CANARY.after_forward(state, batch, CANARY.kv_sources(full_k=k, full_v=v))


def _args():
    kv = S((NUM_SLOTS // PAGE, PAGE, 2, 64), jnp.bfloat16)
    state = jax.tree.map(lambda x: S(x.shape, x.dtype), CANARY.init_state())
    i32 = lambda *shape: S(shape, jnp.int32)  # noqa: E731
    batch = kc.CanaryBatch(
        *(i32(BATCH) for _ in range(3)),
        i32(ROWS, CONTEXT),
        *(i32(TOKENS) for _ in range(3)),
        expected_input_ids=i32(TOKENS),
    )
    return kv, kv, state, batch


def _lower(platform: str, args=None) -> str:
    step = jax.jit(_step, donate_argnums=(0, 1, 2))
    exporter = export.export(step, platforms=[platform], disabled_checks=compat.export_disabled_checks())
    return exporter(*(args or _args())).mlir_module()


def test_the_wrapped_step_lowers_to_mosaic_for_tpu():
    text = _lower("tpu")
    for name in MOSAIC:
        assert f'kernel_name = "{name}' in text, name
    assert compat.TRITON_CUSTOM_CALL_TARGET not in text
    assert "stablehlo.while" not in text


def test_the_wrapped_step_lowers_to_triton_for_cuda():
    args = _args()  # built outside the abstract target, whose mesh has no devices to run eager ops on
    with compat.cuda_export_target():
        text = _lower("cuda", args)
    for name in TRITON:
        assert f'name = "{name}' in text, name
    assert compat.MOSAIC_CUSTOM_CALL_TARGET not in text
    assert "stablehlo.while" not in text


@pytest.mark.parametrize("platform", ["cpu"])
def test_the_wrapped_step_with_pallas_refuses_a_platform_without_kernels(platform):
    with pytest.raises(NotImplementedError, match=r"backend='pallas'.*lowered for 'cpu'"):
        _lower(platform)
