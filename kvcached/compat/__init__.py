"""Upstream kvcached's API over our implementation, in one wing (docs/COMPAT.md).

``upstream_manager``   upstream's ``KVCacheManager`` over the core ``BlockManager``:
                       its constructor and shorthands (``manager_args``), its
                       revisioned limit, resize and snapshots
``vllm_interfaces``    the engine interfaces; ``kvcached.integration.<engine>.interfaces``,
``sglang_interfaces``  upstream's import paths, hand them on
``runtime``            the process-wide state behind them (one init, each KV group's
                       geometry, the managers made here)
``vllm_kv``            vLLM views at kernel-block granularity, ``HYBRID_LINEAR``,
                       ``return_meta``, ``build_kv_views``
``sglang_mamba``       SGLang's mamba state tensors (``alloc_mamba_states``)
``snapshots``          the interfaces' runtime snapshot

The wing stands on the core (``block_manager``, ``limits``, ``kv_views``,
``vmm_ops``) and imports no engine adapter (``kvcached.integration``); the
adapters may stand on it (SGLang's pools are made through ``sglang_interfaces``).
"""
