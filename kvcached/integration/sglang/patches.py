"""The SGLang patches, one per seam, each with the seam shape it is written for.

Supported: the releases of ``profile.RELEASES`` (SGLang 0.5.15-0.5.23). Each
patch names the shape of the seam it needs (``profile.Seams``); its version
range and the releases where its contract is known to break (``KNOWN_BREAKS``)
follow from the profile. The profile's CI releases (0.5.15 and 0.5.23) run for
real in CI (CPU); every release in between is proven from its source: each
contract of each patch in range holds there (tests/contracts/test_sglang_seams.py).
The seam x version table with file:line evidence is docs/notes/sglang_seams.md.

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
  idle sleeper             IdleSleeper.__init__/maybe_sleep: poller (all; --sleep-on-idle)
  memory saver             SchedulerWeightUpdaterManager.release/resume_memory_occupation (all)
  hierarchical cache       HiCacheController.__init__/start_writing/start_loading (all)

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

from kvcached.integration.patch_base import BasePatch, call_after, deferred_call, wrap_method
from kvcached.integration.seam_table import Needs
from kvcached.integration.sglang import profile

_range = profile.version_range


SUPPORTED = _range(None)
# The shapes other modules and tests ask about.
SWA = _range(("swa", "budget"))

MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin"
CONFIGURATOR_MOD = "sglang.srt.mem_cache.kv_cache_configurator"
WEIGHT_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater"


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

    from kvcached.integration import families
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
        f"does not make elastic (it backs {', '.join(families.sglang_pools())}: README's model families)",
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
_prefill_adder = deferred_call("kvcached.integration.sglang.admission", "patch_prefill_adder")
_check_decode_mem = deferred_call("kvcached.integration.sglang.admission", "patch_check_decode_mem")
_retract_to_limit = deferred_call("kvcached.integration.sglang.admission", "patch_retract_to_limit")


# --------------------------------------------------------------------- scheduler
def _scheduler(mod: ModuleType) -> None:
    from kvcached.integration.sglang import scheduler_hooks as sh

    cls = mod.Scheduler
    call_after(cls, "__init__", lambda self, _out, *a, **k: sh.after_init(self))
    wrap_method(cls, "run_batch", _around_run_batch)
    call_after(cls, "process_batch_result", lambda self, _out, batch, result, *a, **k: sh.after_result(self, result))
    call_after(cls, "on_idle", lambda self, _out, *a, **k: sh.on_idle(self))
    call_after(cls, "flush_cache", lambda self, ok, *a, **k: sh.after_flush(self, ok))
    cls.kvcached_report = sh.kvcached_report


def _around_run_batch(run_batch: Callable) -> Callable:
    from kvcached.integration.sglang import scheduler_hooks as sh

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        sh.before_launch()
        result = run_batch(self, *args, **kwargs)
        sh.after_launch(result)
        return result

    return wrapper


_idle_sleeper = deferred_call("kvcached.integration.sglang.idle_wake", "patch_idle_sleeper")


# ------------------------------------------------------------ hierarchical cache
_hicache = deferred_call("kvcached.integration.sglang.hicache", "patch_cache_controller")


# ----------------------------------------------------------------- memory saver
_memory_saver = deferred_call("kvcached.integration.sglang.memory_saver", "patch_weight_updater")


# The seam a patch's contract reads, where it is not the one the patch needs: the
# SWA builder's contract holds wherever the configurator builds (0.5.16+).
_CONTRACT_SEAM: Dict[str, Needs] = {"sglang-swa-builder": ("builder", "configurator")}


def _specs() -> List[Tuple[str, str, Needs, Callable[[ModuleType], None], str]]:
    p = _spec
    return [
        p("sglang-conflicts-post-init", "sglang.srt.server_args", ("validate", "post_init"),
          _conflicts("__post_init__"),
          "refuse SGLang features that own or re-address the KV memory (ServerArgs.__post_init__)"),
        p("sglang-conflicts", "sglang.srt.server_args", ("validate", "resolve_once"), _conflicts("resolve_once"),
          "refuse SGLang features that own or re-address the KV memory (ServerArgs.resolve_once)"),
        p("sglang-capacity-0.5.15", MIXIN, ("builder", "mixin"),
          _capacity("ModelRunnerKVCacheMixin", "handle_max_mamba_cache"),
          "size the pool from a virtual budget, not from free device memory (model runner)"),
        p("sglang-capacity", CONFIGURATOR_MOD, ("builder", "configurator"),
          _capacity("KVCacheConfigurator", "_handle_max_mamba_cache"),
          "size the pool from a virtual budget, not from free device memory"),
        p("sglang-pool-names-0.5.15", MIXIN, ("pool_class", "mixin"), _pool_names,
          "elastic MHA/MLA pools: the model runner builds them by module-level name"),
        p("sglang-pool-names", CONFIGURATOR_MOD, ("pool_class", "names"), _pool_names,
          "elastic MHA/MLA pools: the configurator builds them by module-level name"),
        p("sglang-pools", CONFIGURATOR_MOD, ("pool_class", "resolver"), _pool_resolver,
          "elastic MHA/MLA pools: the configurator's _resolve_kv_pool_class"),
        p("sglang-pool-buffers-0.5.15", "sglang.srt.mem_cache.memory_pool", ("pool_buffers", "one"),
          _pool_buffers_0_5_15,
          "0.5.15 builds buffers and pointer tables in one _create_buffers"),
        p("sglang-allocators-0.5.15", MIXIN, ("builder", "mixin"), _allocators_0_5_15,
          "elastic token/paged allocators, built by name in the model runner; the result is checked"),
        p("sglang-allocators", CONFIGURATOR_MOD, ("builder", "configurator"), _allocators,
          "elastic token/paged allocators, built by name in the configurator; the result is checked"),
        p("sglang-swa-builder", CONFIGURATOR_MOD, ("swa", "budget"), _swa_builder_name,
          "the elastic SWA composite for hybrid sliding-window models"),
        p("sglang-swa-allocators", "sglang.srt.mem_cache.allocator.swa", ("swa", "budget"), _swa_sub_allocators,
          "elastic sub-allocators inside the SWA composite"),
        p("sglang-mamba-state-0.5.15", MIXIN, ("builder", "mixin"), _mamba_state_0_5_15,
          "elastic Mamba state pool and slot allocator (_init_mamba_pool builds MambaPool by name)"),
        p("sglang-mamba-state", CONFIGURATOR_MOD, ("builder", "configurator"), _mamba_state,
          "elastic Mamba state pool (HybridReqToTokenPool.mamba_pool_cls) and slot allocator"),
        p("sglang-prefill-adder", "sglang.srt.managers.schedule_policy", ("prefill", "adder"), _prefill_adder,
          "prefill admission by what can be mapped now (PrefillAdder reads available_size)"),
        p("sglang-check-decode-mem", "sglang.srt.managers.schedule_batch", ("decode", "check_decode_mem"),
          _check_decode_mem,
          "decode admission by what can be mapped now (retract instead of a failed alloc)"),
        p("sglang-retract-to-limit", "sglang.srt.managers.schedule_batch", None, _retract_to_limit,
          "a lowered limit: retract running requests until their pages fit (check_decode_mem)"),
        p("sglang-scheduler", "sglang.srt.managers.scheduler", None, _scheduler,
          "deferred physical release, prefix-cache bound, idle give-back, kvcached_report"),
        p("sglang-idle-sleeper-wake", "sglang.srt.managers.scheduler_components.idle_sleeper", None, _idle_sleeper,
          "--sleep-on-idle: kvcached's wake_idle_loop (a peer's want, a new limit) ends the idle poll"),
        p("sglang-hicache", "sglang.srt.managers.cache_controller", None, _hicache,
          "--enable-hierarchical-cache: host<->device copies hold their slots' pages until their finish event"),
        p("sglang-memory-saver", WEIGHT_UPDATER, None, _memory_saver,
          "release/resume_memory_occupation of kv_cache: the KV pools give every page back / map on demand again"),
    ]  # fmt: skip


def _spec(name: str, target: str, needs: Needs, apply: Callable[[ModuleType], None], what: str):
    return (name, target, needs, apply, what)


def all_patches() -> List[BasePatch]:
    return [BasePatch(name, target, _range(needs), apply, what) for name, target, needs, apply, what in _specs()]


# ------------------------------------------------------------ known breaks

# The releases tests/contracts/test_sglang_seams.py reads: every supported release.
CHECKED_VERSIONS = tuple(profile.RELEASES)


def _known_breaks() -> Dict[Tuple[str, str], str]:
    out: Dict[Tuple[str, str], str] = {}
    for name, _, needs, _, _ in _specs():
        for release in profile.RELEASES:
            why = profile.why_not(_CONTRACT_SEAM.get(name, needs), release)
            if why:
                out[(name, release)] = why
    return out


# (patch name, version) -> why that patch's seam contract fails on that release:
# every release whose seam has another shape than the patch's contract reads
# (profile.SHAPES says why). The contract test marks them strict xfail (so the
# table cannot go stale: a break that is fixed reports XPASS); a release outside
# the range not listed must pass.
KNOWN_BREAKS: Dict[Tuple[str, str], str] = _known_breaks()
