"""kvcached for SGLang (0.5.15-0.5.23).

``interfaces``       upstream's import path of the API in ``kvcached.compat.sglang_interfaces``
``plugin``           entry points: ``sglang.srt.plugins`` and the autopatch activator
``patches``          the patches, one per seam, each with its SGLang version range
``pool``             elastic MHA/MLA pools over kvcached FTensors
``allocator``        elastic token/paged allocators over a KVCacheManager (version-neutral)
``swa_allocator``    the SWA composite over elastic sub-allocators (0.5.21+)
``admission``        prefill/decode admission by physical capacity where SGLang < 0.5.21 reads
                     available_size() itself (``prefill_budget`` where it asks the allocator);
                     retraction of running requests while they hold pages over a lowered limit
``eviction``         evicting the prefix cache until a condition holds (every release)
``scheduler_hooks``  deferred physical release, prefix-cache bound, idle give-back, kvcached_report
``step_timing``      time kvcached spends on the scheduler thread per step; slow steps logged
``conflicts``        SGLang features kvcached refuses to run with

Only ``interfaces``, ``plugin``, ``patches``, ``step_timing`` and ``conflicts`` are importable
without SGLang.
"""
