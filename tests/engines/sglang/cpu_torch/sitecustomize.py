"""Test-only: lets SGLang (not in its CPU-engine mode) run hybrid-state models on a CPU,
for the family tests' engine processes (native and kvcached alike; on ``PYTHONPATH`` only
for them, never for kvcached itself).

* SGLang's causal conv1d over a request's tokens and its slot's conv state (LFM2's short
  convolutions) is a Triton kernel; here it is ``torch_conv1d`` (``conv_kernels.py``).
* Qwen3-Next's layers build their gated norm on ``torch.get_device_module()``, which on
  the CUDA build of torch installed here answers ``torch.cuda`` without a GPU (SGLang's
  CPU install has torch's CPU build, which answers ``torch.cpu``).
"""

import importlib.abc
import sys

import torch

if not torch.cuda.is_available():
    _get_device_module = torch.get_device_module

    def _cpu_without_gpu(device=None):
        return torch.cpu if device is None else _get_device_module(device)

    torch.get_device_module = _cpu_without_gpu


_CONV = "sglang.srt.layers.attention.mamba.causal_conv1d"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Replaces the conv functions of ``_CONV`` right after it is executed, before any
    model module binds them by name."""

    def find_spec(self, name, path, target=None):
        if name != _CONV:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_replace(module):
            exec_module(module)
            import conv_kernels

            module.causal_conv1d_fn = conv_kernels.causal_conv1d_fn
            module.causal_conv1d_update = conv_kernels.causal_conv1d_update

        loader.exec_module = exec_and_replace
        return spec


if not torch.cuda.is_available():
    import importlib.util

    sys.meta_path.insert(0, _AfterImport())
