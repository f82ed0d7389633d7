"""SGLang features that cannot run together with kvcached, and the refusal.

kvcached owns the KV cache's virtual addresses and its physical memory, page by
page. SGLang has features that own one or the other too (the post-capture VMM
arena commits the KV span itself), or that address the KV cache in ways the elastic pool does not
provide (other pool layouts, widened allocator id spaces, a draft model sharing
the target's allocator, buffers registered with transfer engines). Running with
any of them would either fight over the memory or read pages that kvcached never
mapped, so kvcached refuses at start-up with one line naming the flag to drop.

The checks run twice: in the launching process on the raw ``ServerArgs`` (so
``launch_server``/``Engine`` stop before any child process starts), and again
where the pools are built (so a pool constructed some other way is refused too).
"""

from __future__ import annotations

import logging
import os
from typing import Any, List

from kvcached import config
from kvcached.integration import families

logger = logging.getLogger("kvcached.integration.sglang")

_FIX = "or unset ENABLE_KVCACHED to run without kvcached"


class UnsupportedConfigurationError(ValueError):
    """kvcached cannot serve this SGLang configuration; the message names the fix."""


def refuse(what: str, fix: str) -> UnsupportedConfigurationError:
    """The error for one conflict: ``kvcached: <what>; <fix>, or unset ENABLE_KVCACHED ...``."""
    return UnsupportedConfigurationError(f"kvcached: {what}; {fix}, {_FIX}")


def refuse_unproven_on_device(pool_class: str, device: Any) -> None:
    """Refuses a pool of ``pool_class`` (SGLang's class name) on a device kind its family
    is served on but not proven for (``families.refused_on``: Mamba state on a GPU);
    ``KVCACHED_ALLOW_UNSUPPORTED=1`` builds it anyway, with one warning."""
    kind = families.device_kind(str(device))
    unproven = families.refused_on("sglang", kind).get(pool_class)
    if unproven is None:
        return
    feature, why = unproven
    what = f"{feature} is not supported on {families.DEVICE_WORDS[kind]} yet ({why})"
    if not config.allow_unsupported():
        raise refuse(what, "set KVCACHED_ALLOW_UNSUPPORTED=1 to try it anyway")
    logger.warning("kvcached: KVCACHED_ALLOW_UNSUPPORTED=1: serving it on %s: %s", device, what)


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def post_capture_env_on() -> bool:
    """SGLANG_ENABLE_POST_CAPTURE_KV_SIZING asks for SGLang's own CUDA VMM KV arena."""
    return _env_on("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING")


def server_args_conflicts(args: Any) -> List[UnsupportedConfigurationError]:
    """Every conflict visible in the (raw) ServerArgs and the environment."""
    g = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    found: List[UnsupportedConfigurationError] = []
    # --enable-memory-saver is served: kvcached's buffers are outside its regions and the
    # KV memory follows release/resume_memory_occupation (memory_saver.py).
    if post_capture_env_on():
        found.append(
            refuse(
                "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1 makes SGLang back the KV cache with its own CUDA VMM arena",
                "unset SGLANG_ENABLE_POST_CAPTURE_KV_SIZING",
            )
        )
    if g("speculative_algorithm"):
        found.append(
            refuse(
                "speculative decoding (--speculative-algorithm) gives the draft model a second KV pool that shares "
                "the target's allocator, which the elastic pool does not map",
                "drop --speculative-algorithm",
            )
        )
    mode = g("disaggregation_mode")
    if mode not in (None, "", "null"):
        found.append(
            refuse(
                f"PD disaggregation (--disaggregation-mode {mode}) registers the KV buffers with a transfer engine",
                "drop --disaggregation-mode",
            )
        )
    # --enable-hierarchical-cache is served: its host<->device copies hold their slots' pages
    # until they finish (hicache.py). Its host pool is sized from the device pool, which
    # kvcached makes as large as the device: the host size must be given.
    if g("enable_hierarchical_cache") and not g("hicache_size") and not g("max_total_tokens"):
        found.append(
            refuse(
                "--enable-hierarchical-cache sizes its host pool as --hicache-ratio x the device KV pool, which "
                "kvcached sizes to the whole device (pages are mapped on demand)",
                "give the host pool's size with --hicache-size GB (or cap the pool with --max-total-tokens)",
            )
        )
    for flag, why in (
        ("enable_unified_memory", "the unified memory pool carves every pool out of one byte buffer"),
        ("enable_page_major_kv_layout", "the page-major layout is a different pool class"),
        ("enable_kv_cache_sharding", "KV cache sharding widens the allocator's id space"),
        ("enable_hisparse", "hierarchical sparse attention uses its own device/host allocator"),
    ):
        if g(flag):
            found.append(refuse(f"--{flag.replace('_', '-')}: {why}", f"drop --{flag.replace('_', '-')}"))
    dcp = g("dcp_size")
    if isinstance(dcp, int) and dcp > 1:
        found.append(
            refuse(f"decode context parallelism (--dcp-size {dcp}) widens the allocator's id space", "drop --dcp-size")
        )
    if os.environ.get("SGLANG_MOONCAKE_CUSTOM_MEM_POOL"):
        found.append(
            refuse(
                "SGLANG_MOONCAKE_CUSTOM_MEM_POOL allocates the KV buffers from a custom memory pool",
                "unset SGLANG_MOONCAKE_CUSTOM_MEM_POOL",
            )
        )
    if _env_on("SGLANG_USE_HND_KVCACHE"):
        found.append(
            refuse(
                "SGLANG_USE_HND_KVCACHE=1 selects the HND pool layout (rows are pages, not tokens)",
                "unset SGLANG_USE_HND_KVCACHE",
            )
        )
    return found


def check_server_args(args: Any) -> None:
    """Raises the first conflict (UnsupportedConfigurationError), if any."""
    found = server_args_conflicts(args)
    if found:
        raise found[0]


def check_pool(pool: Any) -> None:
    """Refuses a KV pool whose memory SGLang would manage itself (called in the pool's constructor).
    A memory saver is no reason: the elastic buffers are created outside its regions."""
    if getattr(pool, "post_capture_active", False) or post_capture_env_on():
        raise refuse(
            "the KV pool was built for SGLang's post-capture VMM arena (it owns the KV address range)",
            "unset SGLANG_ENABLE_POST_CAPTURE_KV_SIZING",
        )
    if getattr(pool, "enable_custom_mem_pool", False) or getattr(pool, "custom_mem_pool", None) is not None:
        raise refuse(
            "the KV pool allocates from a custom memory pool (SGLANG_MOONCAKE_CUSTOM_MEM_POOL)",
            "unset SGLANG_MOONCAKE_CUSTOM_MEM_POOL",
        )
