"""Stub of ``vllm._custom_ops`` for SGLang CPU tests (see ``vllm/__init__.py``).

Only the names SGLang imports on the CPU path exist. They must never be called.
Note: ``from vllm import _custom_ops`` (SGLang's fused_moe / layernorm on non-CUDA) also
succeeds with this stub; any attribute other than the ones below raises AttributeError,
so MoE models are not supported under the stub.
"""

KVCACHED_TEST_STUB = True


class StubCalledError(RuntimeError):
    pass


def rotary_embedding(*args, **kwargs):  # pragma: no cover - must never run
    raise StubCalledError(
        "vllm._custom_ops.rotary_embedding is a kvcached test stub and must never be "
        "called; SGLang should use RotaryEmbedding.forward_native on device='cpu'"
    )
