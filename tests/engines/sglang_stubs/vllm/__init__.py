"""Test-only stand-in for the `vllm` package, for SGLang CPU runs.

Put ``tests/engines/sglang_stubs`` on PYTHONPATH for SGLang tests ONLY (never for vLLM
tests, never installed). SGLang 0.5.23 on a non-CUDA, non-``SGLANG_USE_CPU_ENGINE`` device
executes ``from vllm._custom_ops import rotary_embedding`` in
``sglang/srt/layers/rotary_embedding/base.py`` (RotaryEmbedding.__init__) and keeps the
function as ``fallback_rotary_embedding``; on device="cpu" the op dispatches to
``forward_native`` and the fallback is never called. Every function here raises, so any
real use fails loudly instead of computing something wrong.
"""

KVCACHED_TEST_STUB = True
