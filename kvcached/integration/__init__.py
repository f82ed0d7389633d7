"""Engine integrations: ``kvcached.integration.vllm`` and ``kvcached.integration.sglang``.

Each has an ``interfaces`` module with the upstream kvcached names
(``init_kvcached``, ``shutdown_kvcached``, ``alloc_kv_cache``,
``get_kv_cache_manager``). ``families`` is the one table of model families both
engines serve or refuse. Importing this package imports no engine.
"""
