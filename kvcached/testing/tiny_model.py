"""Build a tiny, deterministic Llama checkpoint for offline engine tests.

No model hub is needed: the config, seeded random weights (safetensors) and a
WordLevel tokenizer (saved as ``PreTrainedTokenizerFast``) are written to a folder
that vLLM, SGLang and ``transformers`` can load like any local checkpoint.

Only ``torch``, ``transformers``, ``tokenizers`` and ``safetensors`` are needed.

Tokenizer: one token per word or punctuation run (``Whitespace`` pre-tokenizer, lower
case), unknown words map to ``<unk>``, and ``<s>`` is prepended like Llama does. So
``"w1 w2 w3"`` encodes to exactly 4 ids (BOS + 3), which makes block-aligned prompts
easy to write in tests: ``" ".join(f"w{i}" for i in range(n))`` is ``n + 1`` tokens.
The tokenizer vocabulary has exactly ``vocab_size`` entries, so every id the model can
sample decodes.

Weights are drawn from a seeded ``torch.Generator`` (independent of ``transformers``
init code) with a sharp ``lm_head`` so greedy argmax margins are large and
numerically robust across attention paths (prefix-cache hit vs. miss, batching).

Usage::

    python -m kvcached.testing.tiny_model OUTDIR
"""

from __future__ import annotations

import json
import math
import os
import sys

__all__ = ["build_tiny_llama", "SPECIAL_TOKENS", "BASE_WORDS"]

# id order is fixed: <unk>=0, <s>=1, </s>=2, <pad>=3, then the chat role markers.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]

BASE_WORDS = (
    ". , ! ? : ; ' \" ( ) - 0 1 2 3 4 5 6 7 8 9 "
    "the a an of to and in is it that for on with as was be by this are or at from "
    "not have has had but we you he she they i my your our their what which who how "
    "when where why hello world cat dog fox jumps over lazy quick brown red blue green "
    "one two three four five six seven eight nine ten yes no please thanks tell me "
    "about story write code number list name day time year city river sky"
).split()

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|> ' + message['content'] + ' </s> ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _vocab(vocab_size: int) -> dict[str, int]:
    words: list[str] = []
    seen: set[str] = set()
    for w in SPECIAL_TOKENS + BASE_WORDS:
        if w not in seen:
            seen.add(w)
            words.append(w)
    if vocab_size < len(words):
        raise ValueError(f"vocab_size must be >= {len(words)}, got {vocab_size}")
    i = 0
    while len(words) < vocab_size:
        w = f"w{i}"
        i += 1
        if w not in seen:
            seen.add(w)
            words.append(w)
    return {w: idx for idx, w in enumerate(words)}


def _token_ids(vocab: dict[str, int]) -> dict[str, int]:
    """The word-level tokenizer's special tokens, for the model and generation configs."""
    return dict(bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"])


def _write_tokenizer(path: str, vocab_size: int, max_len: int) -> None:
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = _vocab(vocab_size)
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL_TOKENS)  # already in vocab: keeps the same ids
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", vocab["<s>"])],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    # Older/newer transformers differ on whether these files are written; make sure the
    # three files tests rely on exist.
    stm = os.path.join(path, "special_tokens_map.json")
    if not os.path.exists(stm):
        with open(stm, "w") as f:
            json.dump(
                {
                    "bos_token": "<s>",
                    "eos_token": "</s>",
                    "unk_token": "<unk>",
                    "pad_token": "<pad>",
                    "additional_special_tokens": SPECIAL_TOKENS[4:],
                },
                f,
                indent=2,
            )
    # The chat template must also be in tokenizer_config.json (some loaders ignore
    # chat_template.jinja).
    tcp = os.path.join(path, "tokenizer_config.json")
    with open(tcp) as f:
        tcfg = json.load(f)
    tcfg["chat_template"] = CHAT_TEMPLATE
    # transformers 5 writes "TokenizersBackend" and a list under "extra_special_tokens";
    # transformers 4 knows neither. The portable spelling loads in both.
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = tcfg.pop("extra_special_tokens", None)
    if isinstance(extra, dict):
        tcfg["extra_special_tokens"] = extra
    tcfg["additional_special_tokens"] = SPECIAL_TOKENS[4:]
    with open(tcp, "w") as f:
        json.dump(tcfg, f, indent=2)


def _weights(cfg: dict, seed: int, layers: range, device: str = "cpu", dtype: str = "float32"):
    """The tensors of ``layers`` (plus embeddings, final norm and head with layer 0 /
    the last layer), drawn on ``device`` and stored as ``dtype``: a model of a real
    shape is generated on a GPU in seconds, one shard at a time."""
    import torch

    # One shard holding every layer draws exactly what earlier versions drew.
    g = torch.Generator(device=device).manual_seed(seed if layers.start == 0 else seed * 1_000_003 + layers.start)
    out_dtype = getattr(torch, dtype)
    h = cfg["hidden_size"]
    inter = cfg["intermediate_size"]
    v = cfg["vocab_size"]
    hd = cfg["head_dim"]
    nq = cfg["num_attention_heads"] * hd
    nkv = cfg["num_key_value_heads"] * hd

    def lin(out_f: int, in_f: int, gain: float = 1.0):
        w = torch.randn(out_f, in_f, generator=g, dtype=torch.float32, device=device)
        return w * (gain / math.sqrt(in_f))

    sd = {}
    if layers.start == 0:
        sd["model.embed_tokens.weight"] = torch.randn(v, h, generator=g, dtype=torch.float32, device=device)
    for i in layers:
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = lin(nq, h)
        sd[p + "self_attn.k_proj.weight"] = lin(nkv, h)
        sd[p + "self_attn.v_proj.weight"] = lin(nkv, h)
        sd[p + "self_attn.o_proj.weight"] = lin(h, nq)
        sd[p + "mlp.gate_proj.weight"] = lin(inter, h)
        sd[p + "mlp.up_proj.weight"] = lin(inter, h)
        sd[p + "mlp.down_proj.weight"] = lin(h, inter)
        sd[p + "input_layernorm.weight"] = torch.ones(h, device=device)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h, device=device)
    if layers.stop == cfg["num_hidden_layers"]:
        sd["model.norm.weight"] = torch.ones(h, device=device)
        # Sharp output head: logits spread over several units, so greedy argmax has wide
        # margins and does not flip on float rounding differences between kernels.
        sd["lm_head.weight"] = lin(v, h, gain=8.0)
    return {k: t.to(out_dtype).contiguous().cpu() for k, t in sd.items()}


def build_tiny_llama(
    path: str,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    max_position_embeddings: int = 512,
    intermediate_size: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    layers_per_shard: int = 0,
) -> str:
    """Write a tiny random Llama checkpoint + tokenizer to ``path``; return ``path``.

    Deterministic for a given argument set. ``head_dim`` must be one that the engine's
    attention backend supports (vLLM CPU: 32, 64, 80, 96, 112, 128, ...).
    ``device``/``dtype``: where the weights are drawn and how they are stored (a
    Llama-3-8B shape is drawn on a GPU in bf16 in seconds); ``layers_per_shard`` > 0
    writes one safetensors file per that many layers (host memory stays one shard).
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig

    if num_heads % num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    inter = intermediate_size if intermediate_size is not None else 2 * hidden_size

    vocab = _vocab(vocab_size)
    cfg = {  # the sizes, as the config names them (the weights are drawn from them too)
        "hidden_size": hidden_size,
        "intermediate_size": inter,
        "vocab_size": vocab_size,
        "head_dim": head_dim,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "num_hidden_layers": num_layers,
    }
    special = _token_ids(vocab)
    config = LlamaConfig(
        **cfg,
        **special,
        max_position_embeddings=max_position_embeddings,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        torch_dtype=dtype,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    GenerationConfig(**special).save_pretrained(path)

    step = layers_per_shard if layers_per_shard > 0 else num_layers
    starts = list(range(0, num_layers, step))
    for k, start in enumerate(starts):
        shard = _weights(cfg, seed, range(start, min(start + step, num_layers)), device, dtype)
        name = "model.safetensors" if len(starts) == 1 else f"model-{k + 1:05d}-of-{len(starts):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        del shard
    _write_tokenizer(path, vocab_size, max_position_embeddings)
    return path


# Real shapes for the GPU proof (random weights; the tokenizer is the word-level one).
PRESETS: dict[str, dict] = {
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        max_position_embeddings=8192,
    ),
}
# Llama 3.2 1B: the 8B's vocabulary, heads and context, narrower and shallower.
PRESETS["llama3-1b"] = {
    **PRESETS["llama3-8b"],
    **dict(hidden_size=2048, num_layers=16, head_dim=64, intermediate_size=8192),
}
# The sizes main() takes as flags (defaults: build_tiny_llama's).
_SIZES = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import inspect

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--seed", type=int, default=0)
    defaults = inspect.signature(build_tiny_llama).parameters
    for name in _SIZES:
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=defaults[name].default)
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a real model shape (overrides the sizes)")
    ap.add_argument("--device", default="cpu", help="where weights are drawn (cuda for real shapes)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--layers-per-shard", type=int, default=0)
    a = ap.parse_args(argv)
    sizes = {name: getattr(a, name) for name in _SIZES}
    sizes.update(PRESETS.get(a.preset, {}))
    out = build_tiny_llama(
        a.outdir, seed=a.seed, device=a.device, dtype=a.dtype, layers_per_shard=a.layers_per_shard, **sizes
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
