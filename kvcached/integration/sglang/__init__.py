"""kvcached for SGLang (0.5.23).

``interfaces``       the upstream kvcached API (init, buffers, manager); no SGLang import
``plugin``           entry points: ``sglang.srt.plugins`` and the autopatch activator
``patches``          the version-ranged patches, one per seam
``pool``             elastic MHA/MLA pools over kvcached FTensors
``allocator``        elastic token/paged/SWA allocators over a KVCacheManager
``scheduler_hooks``  deferred physical release, prefix-cache bound, kvcached_report
``conflicts``        SGLang features kvcached refuses to run with

Only ``interfaces``, ``plugin`` and ``conflicts`` are importable without SGLang.
"""
