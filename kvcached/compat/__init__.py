"""What only upstream kvcached's API needs, over our implementation (docs/COMPAT.md).

``vllm_kv``: vLLM KV views at kernel-block granularity, the hybrid
linear-attention layout (``attention_type="HYBRID_LINEAR"``), ``return_meta``
and ``build_kv_views``. ``sglang_mamba``: SGLang's mamba state tensors
(``alloc_mamba_states``). The engine interfaces call these; the plain cases
stay on ``kvcached.integration.kv_views``.
"""
