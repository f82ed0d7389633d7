"""The SGLang patches, one per seam, each with the SGLang versions it is written for.

Supported: SGLang 0.5.15-0.5.23. 0.5.15 and 0.5.23 run for real in CI (CPU);
every release in between is proven from its source: each contract of each patch
in range holds there (tests/contracts/test_sglang_seams.py). The seam x version
table with file:line evidence is docs/notes/sglang_seams.md.

  seam                     0.5.15          0.5.16-0.5.18   0.5.19-0.5.20   0.5.21   0.5.22-0.5.23
  refuse conflicts         __post_init__   __post_init__   resolve_once    resolve_once ...
  KV budget                runner mixin    configurator    configurator    ...
  pool class               mixin names     configurator names ...          names    _resolve_kv_pool_class
  pool buffers             _create_buffers _create_buffers_normal ...
  allocator classes        mixin names     configurator names + built-allocator check ...
  SWA hybrids              refused         refused         refused         swa module names ...
  Mamba state              MambaPool name  mamba_pool_cls  ...             ...      ...
  prefill admission        PrefillAdder    PrefillAdder    PrefillAdder    allocator.create_prefill_budget
  decode admission         check_decode_mem ...            allocator.check_decode_capacity ...
  retract to a limit       check_decode_mem (all)
  scheduler events         Scheduler.__init__/run_batch/process_batch_result/on_idle/flush_cache (all)

A patch's ``apply(module)`` runs once per module object (``patch_base``
marks it); wrappers keep the original in ``__kvcached_wrapped__``. The allocators,
pools and eviction helpers are version-neutral (they own every release entry
point, see ``allocator.py``); what differs between releases is only which of
these patches applies.

Importing this module imports neither SGLang nor torch.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Dict, List, Tuple

from kvcached.integration.patch_base import BasePatch, VersionRange, wrap_method

SUPPORTED = VersionRange.parse(">=0.5.15,<0.5.24")
ALL = SUPPORTED
# Where the pools and allocators are built: ModelRunnerKVCacheMixin._init_pools (0.5.15),
# then KVCacheConfigurator (0.5.16+).
V0515 = VersionRange.parse(">=0.5.15,<0.5.16")
CONFIGURATOR = VersionRange.parse(">=0.5.16,<0.5.24")
# ServerArgs validation: __post_init__ until 0.5.18, resolve_once from 0.5.19.
POST_INIT = VersionRange.parse(">=0.5.15,<0.5.19")
RESOLVE_ONCE = VersionRange.parse(">=0.5.19,<0.5.24")
# Pool class: module-level names until 0.5.21, _resolve_kv_pool_class from 0.5.22.
POOL_NAMES = VersionRange.parse(">=0.5.16,<0.5.22")
POOL_RESOLVER = VersionRange.parse(">=0.5.22,<0.5.24")
# Admission read from available_size() in the scheduler: prefill until 0.5.20, decode until 0.5.18.
PREFILL_ADDER = VersionRange.parse(">=0.5.15,<0.5.21")
DECODE_MEM = VersionRange.parse(">=0.5.15,<0.5.19")
# Hybrid sliding-window models: the composite's admission needs SWAPrefillBudget (0.5.21+).
SWA = VersionRange.parse(">=0.5.21,<0.5.24")

MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin"
CONFIGURATOR_MOD = "sglang.srt.mem_cache.kv_cache_configurator"


# --------------------------------------------------------------------- conflicts
def _conflicts(method: str) -> Callable[[ModuleType], None]:
    def apply(mod: ModuleType) -> None:
        from kvcached.integration.sglang.conflicts import check_server_args

        def make(orig: Callable) -> Callable:
            def validate(self: Any, *a: Any, **k: Any) -> Any:
                # Raw fields are enough and checking first stops before any
                # resolution side effects; children re-check (cheap, same answer).
                check_server_args(self)
                return orig(self, *a, **k)

            return validate

        wrap_method(mod.ServerArgs, method, make)

    return apply


# ---------------------------------------------------------------------- capacity
def virtual_kv_bytes(device: str) -> int:
    """The KV budget an elastic pool is sized for: the device's usable memory.

    It does not depend on what is free when the engine starts: physical pages
    are mapped on demand and capped by the instance limit (kvctl limit) and the
    device. ``--max-total-tokens`` still caps the pool (SGLang applies it after).
    """
    from kvcached.devices import normalize_device
    from kvcached.limits import usable_device_bytes

    return int(usable_device_bytes(normalize_device(device)))


def _capacity(cls_name: str, size_mamba: str) -> Callable[[ModuleType], None]:
    def apply(mod: ModuleType) -> None:
        def make(orig: Callable) -> Callable:
            def _profile_available_bytes(self: Any, pre_model_load_memory: int) -> int:
                budget = virtual_kv_bytes(self.device)
                if getattr(self, "mambaish_config", None) is not None:
                    # As SGLang's own profile does: the Mamba state pool is sized from the
                    # budget (max_mamba_cache_size) and the attention KV gets the rest.
                    budget = int(getattr(self, size_mamba)(budget / (1 << 30)) * (1 << 30))
                return budget

            return _profile_available_bytes

        wrap_method(getattr(mod, cls_name), "_profile_available_bytes", make)

    return apply


# ------------------------------------------------------------------------- pools
def _pool_names(mod: ModuleType) -> None:
    # The builder constructs MHATokenToKVPool / MLATokenToKVPool by their module-level
    # names (and never compares types with them): the elastic subclasses take their place.
    from kvcached.integration.sglang.pool import ElasticMHATokenToKVPool, ElasticMLATokenToKVPool

    mod.MHATokenToKVPool = ElasticMHATokenToKVPool
    mod.MLATokenToKVPool = ElasticMLATokenToKVPool


def _pool_resolver(mod: ModuleType) -> None:
    from kvcached.integration.sglang.pool import ElasticMHATokenToKVPool, ElasticMLATokenToKVPool

    elastic = {mod.MHATokenToKVPool: ElasticMHATokenToKVPool, mod.MLATokenToKVPool: ElasticMLATokenToKVPool}

    def make(orig: Callable) -> Callable:
        def _resolve_kv_pool_class(self: Any, *, kind: str, default: type) -> type:
            cls = orig(self, kind=kind, default=default)
            # Only SGLang's own classes are swapped; a platform's pool class is
            # left alone (and refused by the allocator check below).
            return elastic.get(cls, cls)

        return _resolve_kv_pool_class

    wrap_method(mod.KVCacheConfigurator, "_resolve_kv_pool_class", make)


def _pool_buffers_0_5_15(mod: ModuleType) -> None:
    from kvcached.integration.sglang.pool import ElasticMHATokenToKVPool, create_buffers_0_5_15

    ElasticMHATokenToKVPool._create_buffers = create_buffers_0_5_15


# -------------------------------------------------------------------- allocators
def _allocator_names(mod: ModuleType) -> None:
    # The builders look these names up in their module at call time; the elastic
    # classes construct SGLang's own allocator for a pool that is not elastic.
    from kvcached.integration.sglang import allocator as ea

    mod.TokenToKVPoolAllocator = ea.ElasticTokenToKVPoolAllocator
    mod.PagedTokenToKVPoolAllocator = ea.ElasticPagedTokenToKVPoolAllocator


def check_built_allocator(alloc: Any, pool: Any) -> None:
    """Fail closed: a native allocator over elastic buffers would hand out slots on pages
    nobody maps, and a pool kvcached does not replace would silently run without it."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    from kvcached.integration.sglang.allocator import _ElasticAllocatorMixin
    from kvcached.integration.sglang.conflicts import refuse
    from kvcached.integration.sglang.pool import is_elastic_pool
    from kvcached.integration.sglang.swa_allocator import ElasticSWATokenToKVPoolAllocator

    elastic_alloc = isinstance(alloc, (_ElasticAllocatorMixin, ElasticSWATokenToKVPoolAllocator))
    if is_elastic_pool(pool) and elastic_alloc:
        return
    if type(pool).__name__ == "HybridLinearKVPool":
        # Qwen3-Next / Qwen3.5 / Nemotron-H with a state pool kvcached did not build
        # (a platform's own class, or a pool built outside HybridReqToTokenPool).
        state = type(getattr(pool, "mamba_pool", None)).__name__
        raise refuse(
            f"SGLang's HybridLinearKVPool pairs the attention KV with a {state} state pool kvcached does not back",
            "serve it with SGLang's own MambaPool (no platform pool class), with vLLM 0.29+, or without kvcached",
        )
    if isinstance(alloc, SWATokenToKVPoolAllocator):
        raise refuse(
            f"hybrid sliding-window models need SGLang {SWA} with kvcached ({type(alloc).__name__})",
            f"install an SGLang version in {SWA}",
        )
    raise refuse(
        f"SGLang built {type(alloc).__name__} over {type(pool).__name__}, a combination kvcached "
        "does not make elastic (supported: MHA/GQA and MLA models, SWA and Mamba hybrids)",
        "use a supported model and configuration",
    )


def _refuse_shared_allocator():
    from kvcached.integration.sglang.conflicts import refuse

    return refuse("a draft worker shares the target's allocator (speculative decoding)", "drop --speculative-algorithm")


def _allocators(mod: ModuleType) -> None:
    _allocator_names(mod)

    def make(orig: Callable) -> Callable:
        def _build_token_to_kv_pool_allocator(self: Any, *a: Any, **k: Any) -> Any:
            if k.get("token_to_kv_pool_allocator") is not None:
                raise _refuse_shared_allocator()
            alloc = orig(self, *a, **k)
            check_built_allocator(alloc, k.get("token_to_kv_pool"))
            return alloc

        return _build_token_to_kv_pool_allocator

    wrap_method(mod.KVCacheConfigurator, "_build_token_to_kv_pool_allocator", make)


def _allocators_0_5_15(mod: ModuleType) -> None:
    _allocator_names(mod)

    def make(orig: Callable) -> Callable:
        def _init_pools(self: Any, *a: Any, **k: Any) -> Any:
            if getattr(self, "is_draft_worker", False):
                raise _refuse_shared_allocator()
            out = orig(self, *a, **k)
            check_built_allocator(self.token_to_kv_pool_allocator, self.token_to_kv_pool)
            return out

        return _init_pools

    wrap_method(mod.ModelRunnerKVCacheMixin, "_init_pools", make)


def _swa_builder_name(mod: ModuleType) -> None:
    from kvcached.integration.sglang.swa_allocator import ElasticSWATokenToKVPoolAllocator

    mod.SWATokenToKVPoolAllocator = ElasticSWATokenToKVPoolAllocator


def _swa_sub_allocators(mod: ModuleType) -> None:
    _allocator_names(mod)  # the composite builds its two sub-allocators by these names


# ------------------------------------------------------------------- mamba state
# Applied where the pools are built (the model runner / the configurator), never to
# memory_pool itself, which kvcached's mamba module imports.
def _bind_mamba_allocator(make_pool: Callable) -> Callable:
    from kvcached.integration.sglang.mamba import bind_allocator

    def make(orig: Callable) -> Callable:
        def _init_mamba_pool(self: Any, *a: Any, **k: Any) -> Any:
            out = make_pool(orig, self, *a, **k)
            bind_allocator(self)
            return out

        return _init_mamba_pool

    return make


def _mamba_state_0_5_15(mod: ModuleType) -> None:
    import sys

    from kvcached.integration.sglang.mamba import ElasticMambaPool

    memory_pool = sys.modules[mod.HybridReqToTokenPool.__module__]

    def make_pool(orig: Callable, self: Any, *a: Any, **k: Any) -> Any:
        # _init_mamba_pool builds MambaPool by its module-level name; swapped only
        # for the call, so isinstance checks elsewhere still see SGLang's class.
        native, memory_pool.MambaPool = memory_pool.MambaPool, ElasticMambaPool
        try:
            return orig(self, *a, **k)
        finally:
            memory_pool.MambaPool = native

    wrap_method(mod.HybridReqToTokenPool, "_init_mamba_pool", _bind_mamba_allocator(make_pool))


def _mamba_state(mod: ModuleType) -> None:
    from kvcached.integration.sglang.mamba import ElasticMambaPool

    cls = mod.HybridReqToTokenPool
    if cls.__dict__.get("mamba_pool_cls") is not None and cls.mamba_pool_cls.__name__ == "MambaPool":
        cls.mamba_pool_cls = ElasticMambaPool  # a platform's own pool class is left alone (and refused)
    wrap_method(cls, "_init_mamba_pool", _bind_mamba_allocator(lambda orig, *a, **k: orig(*a, **k)))


# --------------------------------------------------------------------- admission
def _prefill_adder(mod: ModuleType) -> None:
    from kvcached.integration.sglang.admission import patch_prefill_adder

    patch_prefill_adder(mod)


def _check_decode_mem(mod: ModuleType) -> None:
    from kvcached.integration.sglang.admission import patch_check_decode_mem

    patch_check_decode_mem(mod)


def _retract_to_limit(mod: ModuleType) -> None:
    from kvcached.integration.sglang.admission import patch_retract_to_limit

    patch_retract_to_limit(mod)


# --------------------------------------------------------------------- scheduler
def _scheduler(mod: ModuleType) -> None:
    from kvcached.integration.sglang import scheduler_hooks as sh

    def make_init(orig: Callable) -> Callable:
        def __init__(self: Any, *a: Any, **k: Any) -> None:
            orig(self, *a, **k)
            sh.after_init(self)

        return __init__

    def make_run(orig: Callable) -> Callable:
        def run_batch(self: Any, batch: Any, *a: Any, **k: Any) -> Any:
            result = orig(self, batch, *a, **k)
            sh.after_launch(result)
            return result

        return run_batch

    def make_process(orig: Callable) -> Callable:
        def process_batch_result(self: Any, batch: Any, result: Any, *a: Any, **k: Any) -> Any:
            out = orig(self, batch, result, *a, **k)
            sh.after_result(self, result)
            return out

        return process_batch_result

    def make_idle(orig: Callable) -> Callable:
        def on_idle(self: Any, *a: Any, **k: Any) -> Any:
            out = orig(self, *a, **k)
            sh.on_idle(self)
            return out

        return on_idle

    def make_flush(orig: Callable) -> Callable:
        def flush_cache(self: Any, *a: Any, **k: Any) -> Any:
            ok = orig(self, *a, **k)
            sh.after_flush(self, ok)
            return ok

        return flush_cache

    cls = mod.Scheduler
    wrap_method(cls, "__init__", make_init)
    wrap_method(cls, "run_batch", make_run)
    wrap_method(cls, "process_batch_result", make_process)
    wrap_method(cls, "on_idle", make_idle)
    wrap_method(cls, "flush_cache", make_flush)
    cls.kvcached_report = sh.kvcached_report


def all_patches() -> List[BasePatch]:
    p = BasePatch
    return [
        p("sglang-conflicts-post-init", "sglang.srt.server_args", POST_INIT, _conflicts("__post_init__"),
          "refuse SGLang features that own or re-address the KV memory (ServerArgs.__post_init__)"),
        p("sglang-conflicts", "sglang.srt.server_args", RESOLVE_ONCE, _conflicts("resolve_once"),
          "refuse SGLang features that own or re-address the KV memory (ServerArgs.resolve_once)"),
        p("sglang-capacity-0.5.15", MIXIN, V0515, _capacity("ModelRunnerKVCacheMixin", "handle_max_mamba_cache"),
          "size the pool from a virtual budget, not from free device memory (model runner)"),
        p("sglang-capacity", CONFIGURATOR_MOD, CONFIGURATOR,
          _capacity("KVCacheConfigurator", "_handle_max_mamba_cache"),
          "size the pool from a virtual budget, not from free device memory"),
        p("sglang-pool-names-0.5.15", MIXIN, V0515, _pool_names,
          "elastic MHA/MLA pools: the model runner builds them by module-level name"),
        p("sglang-pool-names", CONFIGURATOR_MOD, POOL_NAMES, _pool_names,
          "elastic MHA/MLA pools: the configurator builds them by module-level name"),
        p("sglang-pools", CONFIGURATOR_MOD, POOL_RESOLVER, _pool_resolver,
          "elastic MHA/MLA pools: the configurator's _resolve_kv_pool_class"),
        p("sglang-pool-buffers-0.5.15", "sglang.srt.mem_cache.memory_pool", V0515, _pool_buffers_0_5_15,
          "0.5.15 builds buffers and pointer tables in one _create_buffers"),
        p("sglang-allocators-0.5.15", MIXIN, V0515, _allocators_0_5_15,
          "elastic token/paged allocators, built by name in the model runner; the result is checked"),
        p("sglang-allocators", CONFIGURATOR_MOD, CONFIGURATOR, _allocators,
          "elastic token/paged allocators, built by name in the configurator; the result is checked"),
        p("sglang-swa-builder", CONFIGURATOR_MOD, SWA, _swa_builder_name,
          "the elastic SWA composite for hybrid sliding-window models"),
        p("sglang-swa-allocators", "sglang.srt.mem_cache.allocator.swa", SWA, _swa_sub_allocators,
          "elastic sub-allocators inside the SWA composite"),
        p("sglang-mamba-state-0.5.15", MIXIN, V0515, _mamba_state_0_5_15,
          "elastic Mamba state pool and slot allocator (_init_mamba_pool builds MambaPool by name)"),
        p("sglang-mamba-state", CONFIGURATOR_MOD, CONFIGURATOR, _mamba_state,
          "elastic Mamba state pool (HybridReqToTokenPool.mamba_pool_cls) and slot allocator"),
        p("sglang-prefill-adder", "sglang.srt.managers.schedule_policy", PREFILL_ADDER, _prefill_adder,
          "prefill admission by what can be mapped now (PrefillAdder reads available_size)"),
        p("sglang-check-decode-mem", "sglang.srt.managers.schedule_batch", DECODE_MEM, _check_decode_mem,
          "decode admission by what can be mapped now (retract instead of a failed alloc)"),
        p("sglang-retract-to-limit", "sglang.srt.managers.schedule_batch", ALL, _retract_to_limit,
          "a lowered limit: retract running requests until their pages fit (check_decode_mem)"),
        p("sglang-scheduler", "sglang.srt.managers.scheduler", ALL, _scheduler,
          "deferred physical release, prefix-cache bound, idle give-back, kvcached_report"),
    ]  # fmt: skip


# ------------------------------------------------------------ known breaks

# The releases tests/contracts/test_sglang_seams.py reads: every release in the
# range (docs/notes/sglang_seams.md has the evidence).
CHECKED_VERSIONS = (
    "0.5.15",
    "0.5.15.post1",
    "0.5.16",
    "0.5.17",
    "0.5.18",
    "0.5.19",
    "0.5.20",
    "0.5.21",
    "0.5.22",
    "0.5.23",
)

# (patch name, version) -> why that patch's seam contract fails on that release.
# Only releases outside the patch's range belong here: the contract test marks
# them strict xfail (so the table cannot go stale: a break that is fixed reports
# XPASS); a release outside the range not listed must pass.
_V = CHECKED_VERSIONS
_0515 = _V[:2]  # 0.5.15, 0.5.15.post1
_NO_MIXIN = "0.5.16+: the pools are built by KVCacheConfigurator; model_runner_kv_cache_mixin is gone"
_NO_CONFIGURATOR = "0.5.15: no KVCacheConfigurator; ModelRunnerKVCacheMixin._init_pools builds the pools"

KNOWN_BREAKS: Dict[Tuple[str, str], str] = {
    **{("sglang-conflicts-post-init", v): "0.5.19+: ServerArgs validates in resolve_once() (sglang-conflicts); "
       "0.5.20+ declares its fields in arg_groups/fields" for v in _V[5:]},
    **{("sglang-conflicts", v): "before 0.5.19: no ServerArgs.resolve_once; __post_init__ validates "
       "(sglang-conflicts-post-init)" for v in _V[:5]},
    **{("sglang-capacity-0.5.15", v): _NO_MIXIN + " (sglang-capacity)" for v in _V[2:]},
    **{("sglang-capacity", v): _NO_CONFIGURATOR + " and profiles (sglang-capacity-0.5.15)" for v in _0515},
    **{("sglang-pool-names-0.5.15", v): _NO_MIXIN + " (sglang-pool-names)" for v in _V[2:]},
    **{("sglang-pool-names", v): _NO_CONFIGURATOR + " (sglang-pool-names-0.5.15)" for v in _0515},
    **{("sglang-pool-names", v): "0.5.22+: _resolve_kv_pool_class picks the pool class and compares it with "
       "the module's pool classes (sglang-pools)" for v in _V[8:]},
    **{("sglang-pools", v): "before 0.5.22: no _resolve_kv_pool_class; the builders use the module-level names "
       "(sglang-pool-names, sglang-pool-names-0.5.15)" for v in _V[:8]},
    **{("sglang-pool-buffers-0.5.15", v): "0.5.16+: _create_buffers carves the plain layout in "
       "_create_buffers_normal, which the elastic pool overrides" for v in _V[2:]},
    **{("sglang-allocators-0.5.15", v): _NO_MIXIN + " (sglang-allocators)" for v in _V[2:]},
    **{("sglang-allocators", v): _NO_CONFIGURATOR + " (sglang-allocators-0.5.15)" for v in _0515},
    **{("sglang-swa-builder", v): _NO_CONFIGURATOR for v in _0515},
    **{("sglang-mamba-state-0.5.15", v): _NO_MIXIN + " (sglang-mamba-state)" for v in _V[2:]},
    **{("sglang-mamba-state", v): _NO_CONFIGURATOR + " (sglang-mamba-state-0.5.15)" for v in _0515},
    **{("sglang-swa-allocators", v): "before 0.5.20: the SWA composite has no _swa_req_ring; before 0.5.21: no "
       "SWAPrefillBudget (hybrid sliding-window models are refused)" for v in _V[:6]},
    ("sglang-swa-allocators", "0.5.20"): "0.5.20: no SWAPrefillBudget, the composite's prefill admission reads "
    "available_size in PrefillAdder (hybrid sliding-window models are refused)",
    **{("sglang-prefill-adder", v): "0.5.21+: PrefillAdder asks the allocator's create_prefill_budget "
       "(ElasticPrefillBudget)" for v in _V[7:]},
    **{("sglang-check-decode-mem", v): "0.5.19+: check_decode_mem asks the allocator's check_decode_capacity"
       for v in _V[5:]},
}  # fmt: skip
