"""kvcached for SGLang (0.5.15-0.5.23).

``interfaces``       the upstream kvcached API (init, buffers, manager); no SGLang import
``plugin``           entry points: ``sglang.srt.plugins`` and the autopatch activator
``patches``          the patches, one per seam, each with its SGLang version range
``pool``             elastic MHA/MLA pools over kvcached FTensors
``allocator``        elastic token/paged allocators over a KVCacheManager (version-neutral)
``swa_allocator``    the SWA composite over elastic sub-allocators (0.5.21+)
``admission``        prefill/decode admission by physical capacity where SGLang < 0.5.21 reads
                     available_size() itself; ``prefill_budget`` where it asks the allocator
``eviction``         evicting the prefix cache until a condition holds (every release)
``scheduler_hooks``  deferred physical release, prefix-cache bound, idle give-back, kvcached_report
``conflicts``        SGLang features kvcached refuses to run with

Only ``interfaces``, ``plugin``, ``patches`` and ``conflicts`` are importable without SGLang.
"""
