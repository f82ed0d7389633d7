"""Engine integrations: ``kvcached.integration.vllm`` and ``kvcached.integration.sglang``.

Each keeps upstream's ``interfaces`` import path (``init_kvcached``,
``shutdown_kvcached``, ``alloc_kv_cache``, ``get_kv_cache_manager``), which
hands on ``kvcached.compat``'s engine interfaces. ``families`` is the one table
of model families both engines serve or refuse. Importing this package imports
no engine.
"""
