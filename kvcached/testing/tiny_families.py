"""Tiny random-weight checkpoints of model families other than Llama, for engine tests.

Each is built at test time from the ``transformers`` config and model classes (no
downloads), with seeded weights and the word-level tokenizer of ``tiny_model``:

* ``gemma3``: Gemma 3 text model, local (sliding-window) and global layers of the
  same KV geometry. vLLM gives it two KV cache groups (full attention and sliding
  window) sharing one block pool; sliding-window blocks leave a request's block
  table as the window moves.
* ``gemma4``: Gemma 4 text model, whose global layers have a different head size
  (``global_head_dim``) than its local ones: KV specs of different page sizes.
* ``qwen3_next``: Qwen3-Next: gated-delta-net (linear attention) layers beside
  full-attention layers. Each request keeps a recurrent state (blocks of vLLM's
  ``MambaSpec`` group) in the same block pool as the attention KV. Dense MLPs but
  the last layer's (vLLM's Qwen3-Next wants one MoE layer; the dense Qwen3.5 text
  model needs torchvision in vLLM, which breaks transformers on a CPU).
* ``lfm2``: Liquid LFM2: short-convolution layers beside full-attention layers; each
  request keeps the conv state of every conv layer (SGLang's ``MambaPool``, with an
  empty temporal state). Dense MLPs.
* ``deepseek_v2``: DeepSeek-V2 with multi-head latent attention (MLA): one latent
  KV row per token and layer (``kv_lora_rank`` + ``qk_rope_head_dim``), K and V of
  different head sizes; dense MLPs only (no routed experts: MoE kernels are beside
  the point of a KV cache test).

Weights: every floating tensor is drawn from a seeded ``torch.Generator``
(matrices scaled by ``1/sqrt(fan_in)``), with branch outputs that outweigh the
token embedding and an untied, sharp output head: greedy argmax margins are wide
and do not flip on rounding differences between attention paths.

Usage::

    python -m kvcached.testing.tiny_families gemma3 OUTDIR
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Callable, Dict

from kvcached.testing.tiny_model import _token_ids, _vocab, _write_tokenizer

__all__ = ["BUILDERS", "FAMILIES", "build_tiny", "build_tiny_family"]


def _gemma_sizes(sizes: Dict[str, Any]) -> Dict[str, Any]:
    """What the tiny Gemma 3 and Gemma 4 share: 4 layers of 4 query and 2 KV heads of 32.
    ``gpu_shapes``: 6 layers of 8 query and 4 KV heads of 128 (a head size GPU attention
    kernels take; Gemma 4's global layers twice that), hidden size 1024."""
    gpu = sizes.get("gpu_shapes", False)
    return dict(
        vocab_size=sizes["vocab_size"],
        hidden_size=1024 if gpu else 64,
        intermediate_size=2048 if gpu else 128,
        num_hidden_layers=6 if gpu else 4,
        num_attention_heads=8 if gpu else 4,
        num_key_value_heads=4 if gpu else 2,
        head_dim=128 if gpu else 32,
        max_position_embeddings=sizes["max_position_embeddings"],
        sliding_window=sizes["sliding_window"],
    )


def _gemma_layer_types(sizes: Dict[str, Any], pattern: list) -> list:
    """``pattern`` (the 4 tiny layers); with ``gpu_shapes`` Gemma's own 5 local : 1 global
    shortened to 6 layers with two global ones: local, local, global, local, local, global."""
    if sizes.get("gpu_shapes"):
        return ["sliding_attention", "sliding_attention", "full_attention"] * 2
    return pattern


def _gemma3_config(vocab: Dict[str, int], sizes: Dict[str, Any]) -> Any:
    from transformers import Gemma3TextConfig

    shape = _gemma_sizes(sizes)
    cfg = Gemma3TextConfig(
        **shape,
        # Gemma 3's pattern (5 local : 1 global), shortened: local, local, global, local.
        layer_types=_gemma_layer_types(
            sizes, ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        ),
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        query_pre_attn_scalar=shape["head_dim"],
        **_token_ids(vocab),
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Gemma3ForCausalLM"]
    return cfg


def _gemma4_config(vocab: Dict[str, int], sizes: Dict[str, Any]) -> Any:
    from transformers import Gemma4TextConfig

    shape = _gemma_sizes(sizes)
    cfg = Gemma4TextConfig(
        **shape,
        vocab_size_per_layer_input=sizes["vocab_size"],
        global_head_dim=2 * shape["head_dim"],  # global layers: twice the local head size
        layer_types=_gemma_layer_types(
            sizes, ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
        ),
        hidden_size_per_layer_input=0,  # no per-layer input embeddings (Gemma 4 E-models only)
        num_kv_shared_layers=0,
        final_logit_softcapping=None,
        **_token_ids(vocab),
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Gemma4ForCausalLM"]
    return cfg


def _deepseek_v2_config(vocab: Dict[str, int], sizes: Dict[str, Any]) -> Any:
    from transformers import DeepseekV2Config

    # GPU MLA kernels (FlashMLA, FlashAttention-MLA) take DeepSeek's own latent sizes only.
    real = sizes.get("gpu_shapes", False)
    cfg = DeepseekV2Config(
        vocab_size=sizes["vocab_size"],
        hidden_size=1024 if real else 64,
        intermediate_size=2048 if real else 128,
        moe_intermediate_size=32,
        num_hidden_layers=4 if real else 2,
        first_k_dense_replace=4 if real else 2,  # every layer dense (an MoE layer needs expert groups in vLLM)
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        num_attention_heads=16 if real else 4,
        num_key_value_heads=16 if real else 4,
        kv_lora_rank=512 if real else 32,
        q_lora_rank=None,  # q_proj straight from the hidden state (DeepSeek-V2-Lite)
        qk_nope_head_dim=128 if real else 16,
        qk_rope_head_dim=64 if real else 16,
        v_head_dim=128 if real else 16,
        max_position_embeddings=sizes["max_position_embeddings"],
        # DeepSeek-V2's own rope (YaRN; factor 1: no context extension). SGLang's CPU
        # path builds only this rope for MLA (get_rope_cpu: deepseek_yarn).
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 1.0,
            "original_max_position_embeddings": sizes["max_position_embeddings"],
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        **_token_ids(vocab),
        tie_word_embeddings=False,
    )
    # Read by SGLang's DeepSeek-V2 (a field of DeepSeek's own config class, not of transformers').
    cfg.moe_layer_freq = 1
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    return cfg


def _qwen3_next_shape(sizes: Dict[str, Any]) -> Dict[str, Any]:
    """The sizes of the tiny Qwen3-Next's layers. ``real_shapes``: Qwen3-Next-80B-A3B's
    (attention and gated-delta-net sizes, 4 small experts): one layer's recurrent state is
    32 x 128 x 128 values (2 MiB in float32) plus its conv state, larger than the 2 MiB page,
    as in the real model."""
    if sizes.get("real_shapes"):
        return dict(
            hidden_size=2048,
            intermediate_size=2048,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
        )
    return dict(
        hidden_size=64,
        intermediate_size=128,
        # KV of 1 KiB per token: vLLM raises the attention block size until its page is
        # no smaller than one layer's recurrent state (~68 KiB here), so 80-token blocks:
        # a 130-token prompt fills one (a prefix-cache entry) and fits a 128 KiB page.
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        # vLLM's CPU gated-delta-rule kernel takes Qwen3-Next's own head size (128) only.
        # GPU: vLLM 0.26's packed decode kernel needs `a`/`b` (one column per value head, cut
        # from one projection) contiguous, which a single value head is not.
        linear_num_key_heads=2 if sizes.get("gpu_shapes") else 1,
        linear_num_value_heads=4 if sizes.get("gpu_shapes") else 1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )


def _qwen3_next_config(vocab: Dict[str, int], sizes: Dict[str, Any]) -> Any:
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(
        vocab_size=sizes["vocab_size"],
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        mlp_only_layers=[0, 1, 2],
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=sizes["max_position_embeddings"],
        **_qwen3_next_shape(sizes),
        **_token_ids(vocab),
        tie_word_embeddings=False,
    )
    if sizes.get("sglang") and not sizes.get("real_shapes"):
        # SGLang's Qwen3-Next places its attention layers by full_attention_interval and
        # makes every layer's MLP a MoE block (its checkpoint loader expects the weights).
        cfg.full_attention_interval = 2
        cfg.mlp_only_layers = []
    cfg.architectures = ["Qwen3NextForCausalLM"]
    return cfg


def _lfm2_config(vocab: Dict[str, int], sizes: Dict[str, Any]) -> Any:
    from transformers import Lfm2Config

    cfg = Lfm2Config(
        vocab_size=sizes["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        block_auto_adjust_ff_dim=False,
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_L_cache=3,  # the conv kernel width: a slot keeps the last 2 inputs per layer
        max_position_embeddings=sizes["max_position_embeddings"],
        **_token_ids(vocab),
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Lfm2ForCausalLM"]
    return cfg


def _model_class(arch: str) -> Any:
    import transformers

    return getattr(transformers, arch)


FAMILIES: Dict[str, Callable[[Dict[str, int], Dict[str, Any]], Any]] = {
    "gemma3": _gemma3_config,
    "gemma4": _gemma4_config,
    "deepseek_v2": _deepseek_v2_config,
    "qwen3_next": _qwen3_next_config,
    "lfm2": _lfm2_config,
}


# Every tiny model a family of ``kvcached.integration.families`` can name as its builder:
# ``llama`` (``tiny_model``) and the families above.
BUILDERS = ("llama", *FAMILIES)


def build_tiny(path: str, builder: str, **kwargs: Any) -> str:
    """Write ``builder``'s tiny model (one of ``BUILDERS``) to ``path``, unless a checkpoint
    is there already; return ``path``. ``kwargs`` go to ``build_tiny_family``."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if builder == "llama":
        from kvcached.testing.tiny_model import build_tiny_llama

        return build_tiny_llama(path, **kwargs)
    return build_tiny_family(path, builder, **kwargs)


def _seed_weights(model: Any, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if not p.is_floating_point():
                continue
            if "post_attention_layernorm" in name or "post_feedforward_layernorm" in name:
                # Gemma normalises each branch's output before the residual add; scaled
                # x4 the branches outweigh the (sharp, scaled) token embedding, so the
                # next token depends on the context, not only on the last token.
                zero_centred = bool((p == 0).all())  # Gemma 3 scales by 1 + w
                p.fill_(3.0 if zero_centred else 4.0)
                continue
            if "norm" in name or p.dim() < 2:
                continue  # other norms keep the class's init
            w = torch.randn(p.shape, generator=g, dtype=torch.float32)
            # Sharp output head (untied): logits spread over several units, so greedy
            # argmax margins are wide and do not flip on rounding differences.
            gain = 8.0 if name.startswith("lm_head") else 1.0
            p.copy_((w * (gain / math.sqrt(p.shape[-1]))).to(p.dtype))


def build_tiny_family(
    path: str,
    family: str,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    max_position_embeddings: int = 4096,
    sliding_window: int = 64,
    gpu_shapes: bool = False,
    real_shapes: bool = False,
    sglang: bool = False,
) -> str:
    """Write a tiny random ``family`` checkpoint + tokenizer to ``path``; return ``path``.

    ``gpu_shapes``: the attention sizes GPU kernels require (DeepSeek-V2's MLA:
    latent 512 + rope 64; Qwen3-Next: more than one value head; Gemma 3 / 4: heads of
    128, Gemma 4's global ones 256, 6 layers), few layers, so the family runs on a GPU
    engine. ``real_shapes`` (Qwen3-Next only): the real model's layer
    sizes, whose state blocks exceed the 2 MiB page. ``sglang``: the layout SGLang's model class loads (Qwen3-Next:
    every layer MoE, attention placed by ``full_attention_interval``)."""
    import torch
    from transformers import GenerationConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {sorted(FAMILIES)}")
    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    vocab = _vocab(vocab_size)
    sizes = dict(
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        sliding_window=sliding_window,
        gpu_shapes=gpu_shapes,
        real_shapes=real_shapes,
        sglang=sglang,
    )
    if real_shapes and family != "qwen3_next":
        raise ValueError("real_shapes: only qwen3_next has them (its state blocks exceed a 2 MiB page)")
    cfg = FAMILIES[family](vocab, sizes)
    cfg.torch_dtype = "float32"
    torch.manual_seed(seed)
    model = _model_class(cfg.architectures[0])(cfg).to(torch.float32)
    _seed_weights(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(**_token_ids(vocab)).save_pretrained(path)
    _write_tokenizer(path, vocab_size, max_position_embeddings)
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family", choices=sorted(FAMILIES))
    ap.add_argument("outdir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="Gemma's local window in tokens (default 64; --gpu-shapes 512, which 2,000-token outputs cross)",
    )
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument(
        "--gpu-shapes",
        action="store_true",
        help="attention sizes GPU kernels require (MLA: 512 + 64; Qwen3-Next: 4 value heads; Gemma: heads of 128)",
    )
    ap.add_argument(
        "--real-shapes",
        action="store_true",
        help="qwen3_next: the real model's layer sizes (state blocks larger than the 2 MiB page)",
    )
    ap.add_argument(
        "--sglang",
        action="store_true",
        help="the layout SGLang's model class loads (qwen3_next: every layer MoE); vLLM's by default",
    )
    a = ap.parse_args(argv)
    path = build_tiny_family(
        a.outdir,
        a.family,
        seed=a.seed,
        sliding_window=a.sliding_window or (512 if a.gpu_shapes else 64),
        vocab_size=a.vocab_size,
        gpu_shapes=a.gpu_shapes,
        real_shapes=a.real_shapes,
        sglang=a.sglang,
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
