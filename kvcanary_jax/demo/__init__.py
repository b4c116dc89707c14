"""Demo model and scheduler for kvcanary-jax: a tiny paged-KV transformer and the host loop that feeds it."""

from kvcanary_jax.demo.allocator import PADDING_SLOT as PADDING_SLOT
from kvcanary_jax.demo.allocator import ReqToTokenPool as ReqToTokenPool
from kvcanary_jax.demo.allocator import SlotAllocator as SlotAllocator
from kvcanary_jax.demo.allocator import SwaPool as SwaPool
from kvcanary_jax.demo.batch import StepBatch as StepBatch
from kvcanary_jax.demo.batch import oracle_token as oracle_token
from kvcanary_jax.demo.loop import DemoSetup as DemoSetup
from kvcanary_jax.demo.loop import build_demo as build_demo
from kvcanary_jax.demo.loop import demo_step as demo_step
from kvcanary_jax.demo.model import KvCache as KvCache
from kvcanary_jax.demo.model import KvCacheLayout as KvCacheLayout
from kvcanary_jax.demo.model import ModelConfig as ModelConfig
from kvcanary_jax.demo.model import Params as Params
from kvcanary_jax.demo.model import dense_forward as dense_forward
from kvcanary_jax.demo.model import forward as forward
from kvcanary_jax.demo.model import init_kv_cache as init_kv_cache
from kvcanary_jax.demo.model import init_params as init_params
from kvcanary_jax.demo.radix import RadixCache as RadixCache
from kvcanary_jax.demo.scheduler import Request as Request
from kvcanary_jax.demo.scheduler import Scheduler as Scheduler
from kvcanary_jax.demo.scheduler import SchedulerConfig as SchedulerConfig

__all__ = [
    "PADDING_SLOT",
    "DemoSetup",
    "KvCache",
    "KvCacheLayout",
    "ModelConfig",
    "Params",
    "RadixCache",
    "ReqToTokenPool",
    "Request",
    "Scheduler",
    "SchedulerConfig",
    "SlotAllocator",
    "StepBatch",
    "SwaPool",
    "build_demo",
    "demo_step",
    "dense_forward",
    "forward",
    "init_kv_cache",
    "init_params",
    "oracle_token",
]
