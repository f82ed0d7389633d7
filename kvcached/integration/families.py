"""Model families: the one declared table of what kvcached serves, where each family was
proven, and what it refuses.

A family is a kind of model as the KV cache sees it (full attention, a sliding window
beside global layers, latent attention, recurrent state beside attention, ...). Its
entry (``Family``) says:

* ``vllm_specs``: the vLLM KV cache spec classes (``vllm.v1.kv_cache_interface``) that
  mark it (a spec class marks one family); ``vllm_patches``: the version patches
  (``vllm/versions.py``) that serve those specs, where they are not served everywhere;
* ``sglang_pools``: the SGLang pool classes that hold its KV (or state);
* ``builders``: the tiny random-weight models it is tested with
  (``kvcached.testing.tiny_families.BUILDERS``) and ``cases``: the family engine tests'
  parametrization (``tests/engines/{vllm,sglang}/test_model_families.py``), each case
  with the builder of its model;
* per engine and device kind (``cpu``, ``gpu``) a ``Status``: proven (greedy tokens
  identical to the engine without kvcached; on which releases, in CI or by hand),
  proven from the engine's own classes only, not run (and why), or refused (and why:
  the refusal's reason).

From this table come: the spec classes vLLM's layout plan serves and the feature a
refusal names (``vllm/kv_layout.py``: ``SUPPORTED_SPECS``, ``refuse_unsupported_model``),
the refusals of a family not proven on a device kind (``kv_layout.refuse_unproven_on_device``,
``sglang/conflicts.refuse_unproven_on_device``), the pools SGLang's refusals name
(``sglang/patches.py``, ``sglang/allocator.py``), the family tests' parametrization and
README's family table (``readme_section``; ``python3 kvcached/integration/families.py readme``
prints it, ``tests/integration/test_families.py`` checks README has it).

A new family is one entry here, its tiny model's builder (``tiny_families.FAMILIES``) and,
for each case it names, a workload in the family test. Moving a family from "not run" to
proven (or refused) is one edit of its ``Status``.

Standard library and the version profiles only: no engine import (the layout plan, the
SGLang modules and README's check all read it; it runs as a script).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvcached.integration.sglang import profile as sglang_profile  # noqa: E402
from kvcached.integration.vllm import profile as vllm_profile  # noqa: E402

ENGINES = ("vllm", "sglang")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
DEVICES = ("cpu", "gpu")
DEVICE_WORDS = {"cpu": "a CPU", "gpu": "a GPU"}

# What a Status says.
PROVEN = "proven"  # ran on the engine with kvcached: greedy tokens identical to the engine without it
CLASSES = "classes"  # proven from the engine's own classes; the engine itself cannot run the family here
NOT_RUN = "not run"  # served, never run on that engine and device kind
REFUSED = "refused"  # start-up stops with one line naming it (``text``: why)


@dataclasses.dataclass(frozen=True)
class Status:
    """Where one family stands on one engine and device kind."""

    state: str
    # The releases it ran on (PROVEN). Empty with ``ci``: the releases the engine's
    # profile runs in CI (``profile.ci_versions()``), so the claim follows the matrix.
    versions: Tuple[str, ...] = ()
    ci: bool = False  # run in CI (the CPU engines)
    text: str = ""  # what ran, or why not; for REFUSED the reason the refusal line gives
    ref: str = ""  # where the evidence is, when not the family tests (a test file or document)

    def releases(self, engine: str) -> Tuple[str, ...]:
        """The releases this status names: its own, or (in CI) the engine's CI releases."""
        if self.versions or not self.ci:
            return self.versions
        if engine == "vllm":
            return tuple(_minor(v) for v in vllm_profile.ci_versions())
        return tuple(sglang_profile.ci_versions())


@dataclasses.dataclass(frozen=True)
class Case:
    """One parametrization of a family engine test: its id and the builder of its model."""

    engine: str
    name: str
    builder: str


# A family nobody has run on a GPU yet (served there, unproven: the table says so).
_NOT_RUN = Status(NOT_RUN)


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its engine classes, its tests and where it stands."""

    key: str
    name: str  # README's first cell
    feature: str  # what a refusal names ("kvcached does not support <feature> ...")
    vllm_cpu: Status
    sglang_cpu: Status
    vllm_gpu: Status = _NOT_RUN
    sglang_gpu: Status = _NOT_RUN
    vllm_specs: Tuple[str, ...] = ()
    vllm_patches: Tuple[str, ...] = ()
    sglang_pools: Tuple[str, ...] = ()
    builders: Tuple[str, ...] = ()
    cases: Tuple[Case, ...] = ()

    def status(self, engine: str, device: str) -> Status:
        """The family's status on ``engine`` ("vllm", "sglang") and device kind ("cpu", "gpu")."""
        return getattr(self, f"{engine}_{device}")

    def served(self, engine: str) -> bool:
        """kvcached backs the family on ``engine`` on some device kind (refused on all: not)."""
        return any(self.status(engine, d).state != REFUSED for d in DEVICES)


_GPU_DOC = "docs/GPU.md"  # the record of every run on the lent H200


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def ci(text: str = "", *, versions: Sequence[str] = (), ref: str = "") -> Status:
    """Proven on the engine's CPU build in CI (on ``versions``, else on every CI release)."""
    return Status(PROVEN, tuple(versions), True, text, ref)


def h200(versions: Sequence[str], text: str, ref: str = _GPU_DOC) -> Status:
    """Proven by hand on the lent H200, with a native control."""
    return Status(PROVEN, tuple(versions), False, text, ref)


def classes(text: str, ref: str) -> Status:
    """Proven from the engine's own classes (``ref``: the test); ``text`` says why not on the engine."""
    return Status(CLASSES, text=text, ref=ref)


def not_run(text: str = "") -> Status:
    """Served but not run there (``text``: why not, where the engine cannot run it)."""
    return Status(NOT_RUN, text=text)


def refused(why: str = "") -> Status:
    """Refused at start-up in one line; ``why`` is the reason the line gives."""
    return Status(REFUSED, text=why)


# SGLang refuses a family it has no pool for where it builds one: not run per family.
_SGLANG_REFUSES = refused("when SGLang builds a pool or allocator kvcached does not back (built-allocator check)")


def _refused_everywhere(key: str, name: str, feature: str, spec: str) -> Family:
    """A family of one vLLM spec class kvcached refuses on every engine and device kind:
    it frees, sizes or writes blocks in ways no run on a real engine has checked."""
    return Family(
        key,
        name,
        feature,
        vllm_cpu=refused(),
        sglang_cpu=_SGLANG_REFUSES,
        vllm_gpu=refused(),
        sglang_gpu=_SGLANG_REFUSES,
        vllm_specs=(spec,),
    )


_HYBRID_GPU_WHY = (
    "on the H200 (vLLM 0.26) a Qwen3-Next gave other greedy tokens than without kvcached in 29 and 19 of 200 "
    "sequences in two of three runs, each with native's very schedule; on H100s 0 of 200 in the ten runs "
    "since (three with kernel configs pinned) and twice under a limit (32 preemptions, native's block count "
    "and schedule); kernel configs each process picks by timing may explain it (an MLA native so differed "
    f"from itself): three pinned runs on the H200 decide: {_GPU_DOC}"
)
FAMILIES: Tuple[Family, ...] = (
    Family(
        "full_attention",
        "full attention (Llama, Qwen, Mistral, ...)",
        "full attention",
        vllm_cpu=ci(ref="tests/engines/vllm/test_servers.py"),
        vllm_gpu=h200(
            ["0.26", "0.29"],
            "V2 runner, async scheduling, CUDA graphs, FlashAttention 3; 0 of 200 sequences differ from native, "
            "as from a second native run (both releases; 0.29 on an H100), and on 0.26 0 of 200 with "
            "batch-invariant kernels under a 4 GiB limit (176 preemptions); on 0.29 under that limit undecided: "
            "kvcached and native with a pool that small differ in 178 with one schedule from the first token, "
            "two such natives in none; kernel configs each process picks by timing (seen for MLA) may explain "
            "it: a run with them pinned decides next",
        ),
        sglang_cpu=ci(ref="tests/engines/sglang/test_engine.py"),
        sglang_gpu=h200(
            ["0.5.17"],
            "`launch_server` unchanged (FA3, overlap scheduler, CUDA graphs, radix cache); 0 of 200 sequences "
            "differ from native at page sizes 1 and 16 and under a 6 GiB limit, each beside a native control",
        ),
        vllm_specs=("FullAttentionSpec",),
        sglang_pools=("MHATokenToKVPool",),
        builders=("llama",),
    ),
    Family(
        "fp8_kv",
        "FP8 KV cache",
        "an FP8 KV cache",
        vllm_cpu=ci("`kv_cache_dtype=fp8` (x86 with AVX-512 or AMX)"),
        vllm_gpu=h200(
            ["0.26", "0.29"],
            "H100, `kv_cache_dtype=fp8_e4m3`, Llama-3.2-1B shape: 0 of 200 sequences differ from native, as "
            "from a second native (both releases), and 0 of 200 under a 1 GiB limit (58 preemptions) against "
            "native with a pool that small and with batch-invariant kernels",
        ),
        sglang_cpu=ci("`--kv-cache-dtype fp8_e4m3`"),
        sglang_gpu=h200(
            ["0.5.17"],
            "H100, `--kv-cache-dtype fp8_e4m3`, Llama-3.2-1B shape: 0 of 200 sequences differ from native, as "
            "from a second native, and 0 of 200 under a 1 GiB limit (deterministic inference, the limit reached) "
            "against deterministic native and against native with a pool that small",
        ),
        # A dtype of full attention: no spec class of its own.
        sglang_pools=("MHATokenToKVPool",),
        builders=("llama",),
        cases=(Case("vllm", "llama-fp8", "llama"), Case("sglang", "llama-fp8", "llama")),
    ),
    Family(
        "sliding_window",
        "sliding window + global layers (Gemma 3)",
        "sliding-window attention",
        vllm_cpu=ci("4 requests x 2,000 tokens, window blocks return to the pool"),
        sglang_cpu=ci(
            "a 2,000-token decode; SGLang serves Gemma 3 from one pool (its hybrid SWA memory is off for "
            "Gemma 2/3), the window a mask; SWA composite pools from SGLang's classes (0.5.21+)"
        ),
        # Refused on a GPU from 12-05 (one gemma3-limit run at f42a9d3 differed in 175 of 200) to 12-06,
        # when five runs under a limit at c5913be (CUDA graphs and async scheduling three times, eager,
        # no async scheduling) were all identical with native-small's schedule: docs/GPU.md says what differs.
        vllm_gpu=h200(
            ["0.26", "0.29"],
            "H100, tiny Gemma 3 (window 512), outputs to 2,386 tokens crossing it: 0 of 200 sequences differ "
            "from native, as from a second native (both releases); on 0.26 under a 512 MiB limit (46 "
            "preemptions, batch-invariant kernels) 0 of 200 differ from native with a pool that small, with its "
            "very schedule, in five runs (CUDA graphs and async scheduling three times, eager, synchronous); "
            "one earlier run at f42a9d3 differed in 175 and is not reproduced",
        ),
        sglang_gpu=h200(
            ["0.5.17"],
            "H100, tiny Gemma 3 (window 512) in SGLang's one pool: 0 of 200 sequences differ from native, as "
            "from a second native, and 0 of 200 under a 512 MiB limit (a quarter of the load's need; deterministic "
            "inference) against deterministic native and against native with a pool that small",
        ),
        vllm_specs=("SlidingWindowSpec",),
        sglang_pools=("MHATokenToKVPool", "SWAKVPool"),
        builders=("gemma3",),
        cases=(Case("vllm", "gemma3", "gemma3"), Case("sglang", "gemma3", "gemma3")),
    ),
    Family(
        "head_sizes",
        "layers of different KV head sizes (Gemma 4)",
        "layers of different KV head sizes",
        vllm_cpu=ci(
            "hybrid and one-group (vLLM 0.26 cannot load Gemma 4 with transformers 5.x)", versions=["0.29", "0.32"]
        ),
        vllm_gpu=h200(
            ["0.29"],
            "H100, tiny Gemma 4 (global layers of head size 256 beside local ones of 128), outputs to 2,386 "
            "tokens: 0 of 200 sequences differ from native, as from a second native; under a 768 MiB limit "
            "(50 preemptions, batch-invariant kernels) 0 of 200 differ from native with a pool that small, "
            "with its very schedule, nor from unlimited native (0.26 with transformers 5.17 refuses its "
            "per-layer `head_dim`)",
        ),
        sglang_cpu=classes(
            "SWA composite with sub-pools of head sizes 32 and 64 from SGLang's classes (0.5.23); SGLang's CPU "
            "build cannot run Gemma 4 (its attention backends)",
            "tests/engines/sglang/test_pools_allocators.py",
        ),
        # Gemma 3's spec classes (in one group: UniformTypeKVCacheSpecs); the mark is a head size.
        sglang_pools=("SWAKVPool",),
        builders=("gemma4",),
        cases=(Case("vllm", "gemma4", "gemma4"), Case("vllm", "gemma4-one-group", "gemma4")),
    ),
    Family(
        "mla",
        "MLA (DeepSeek V2/V3, Kimi)",
        "multi-head latent attention (MLA)",
        vllm_cpu=not_run("vLLM's CPU build has no MLA attention"),
        vllm_gpu=h200(
            ["0.26", "0.29"],
            "FlashAttention-MLA, CUDA graphs, async scheduling; tiny DeepSeek-V2 with the real 512 + 64 latent: "
            "200 prompts, outputs to 2,386 tokens, identical with and without kvcached, as with a native "
            "control; under a 216 MiB limit on 18 MiB pages (116 preemptions) 0 of 200 differ from native with "
            "kvcached's block count, tensors and schedule, 3 from unlimited native, each after a recompute "
            "(MLA's recompute is not bit-equal); 0.29 (H100): 0 of 200 differ from a "
            "second native, which matches kvcached, while the first native run differs from both in 93 (native's "
            "own noise)",
        ),
        sglang_cpu=classes(
            "MLA pool layout equals SGLang's (`test_pools_allocators.py`); SGLang's CPU build cannot run a "
            "tiny DeepSeek-V2",
            "docs/notes/sglang_seams.md",
        ),
        sglang_gpu=h200(
            ["0.5.17"],
            "`launch_server` unchanged (its MLA backend, overlap scheduler, CUDA graphs, radix cache); tiny "
            "DeepSeek-V2 with the real 512 + 64 latent: 0 of 200 sequences differ from native, as from a "
            "second native run",
        ),
        vllm_specs=("MLAAttentionSpec",),
        sglang_pools=("MLATokenToKVPool",),
        builders=("deepseek_v2",),
    ),
    Family(
        "hybrid_state",
        "hybrid Mamba / gated-delta-net / short-conv (Qwen3-Next, Qwen3.5, LFM2)",
        "Mamba / linear-attention state",
        vllm_cpu=ci(
            "tiny Qwen3-Next, bfloat16, float32 SSM state: state and KV blocks in one elastic pool and "
            "budget, charged exactly the pages they map (0.29+: layer regions moved to page boundaries, "
            "`docs/notes/vllm_seams.md`); a real model's state blocks larger than the 2 MiB page get a page "
            "that holds them, chosen from the model's spec at start-up (no variable; a `KVCACHED_PAGE_SIZE` "
            "that is set is kept, and one too small is refused naming the size to use)"
        ),
        vllm_gpu=refused(_HYBRID_GPU_WHY),
        sglang_cpu=ci(
            "tiny LFM2 (short-conv state in SGLang's `MambaPool`): state slots and attention KV both elastic "
            "(records `<name>_g1` and `<name>`), identical tokens with multi-turn prefix hits, retraction, "
            "eviction and a 2,000-token decode; Qwen3-Next starts with both pools elastic but SGLang's CPU "
            "build cannot generate GDN (its kernels are in `sgl_kernel`); state pool from SGLang's classes "
            "(`test_mamba_state.py`); a slot larger than the default page gets a page that holds it (a "
            "`KVCACHED_PAGE_SIZE` that is set and too small stops start-up naming the size)"
        ),
        sglang_gpu=h200(
            ["0.5.17"],
            "H100, tiny Qwen3-Next in SGLang's layout: gated-delta-net state slots (`MambaPool`) and attention "
            "KV both elastic; 0 of 200 sequences differ from native, as from a second native (FA3, overlap "
            "scheduler, CUDA graphs, radix cache: 43% prefix hits)",
        ),
        vllm_specs=("MambaSpec",),
        # MambaSpec state blocks lie where these patches say, per vLLM version.
        vllm_patches=("mamba_state_shared_by_0_28", "mamba_state_0_29"),
        sglang_pools=("HybridLinearKVPool", "MambaPool"),
        builders=("qwen3_next", "lfm2"),
        cases=(Case("vllm", "qwen3-next", "qwen3_next"), Case("sglang", "lfm2", "lfm2")),
    ),
    _refused_everywhere(
        "chunked_local", "chunked local attention (Llama 4)", "chunked local attention", "ChunkedLocalAttentionSpec"
    ),
    _refused_everywhere("sinks", "attention sinks", "attention sinks", "SinkFullAttentionSpec"),
    _refused_everywhere("rswa", "R-SWA", "sliding-window attention (R-SWA)", "RSWASpec"),
    _refused_everywhere("swa_mla", "sliding-window MLA", "sliding-window MLA attention", "SlidingWindowMLASpec"),
    _refused_everywhere("cross", "cross-attention", "cross attention (encoder-decoder)", "CrossAttentionSpec"),
    _refused_everywhere("encoder_only", "encoder-only", "encoder-only attention", "EncoderOnlyAttentionSpec"),
)


# ------------------------------------------------------------------ queries


def family(key: str) -> Family:
    """The family ``key`` of ``FAMILIES``."""
    for f in FAMILIES:
        if f.key == key:
            return f
    raise KeyError(f"no model family {key!r}; one of {[f.key for f in FAMILIES]}")


def device_kind(device: str) -> str:
    """``gpu`` for a CUDA (or ROCm, which torch calls cuda) device string, else ``cpu``."""
    return "gpu" if str(device).startswith("cuda") else "cpu"


def vllm_served_specs() -> Tuple[str, ...]:
    """The vLLM spec classes kvcached backs on every supported version (the families
    served on vLLM whose specs need no version patch; ``vllm_specs_of_patch`` the others)."""
    return tuple(s for f in FAMILIES if f.served("vllm") and not f.vllm_patches for s in f.vllm_specs)


def vllm_specs_of_patch(patch: str) -> Tuple[str, ...]:
    """The vLLM spec classes the version patch ``patch`` serves (the families that name it)."""
    return tuple(s for f in FAMILIES if patch in f.vllm_patches for s in f.vllm_specs)


def vllm_spec_features() -> Dict[str, str]:
    """vLLM spec class -> the feature a refusal of it names."""
    return {s: f.feature for f in FAMILIES for s in f.vllm_specs}


def refused_on(engine: str, kind: str) -> Dict[str, Tuple[str, str]]:
    """``engine``'s classes (vLLM spec classes, SGLang pool classes) of the families it
    serves but refuses on device kind ``kind`` ("cpu", "gpu": ``device_kind``) -> (feature, why)."""
    out: Dict[str, Tuple[str, str]] = {}
    for f in FAMILIES:
        st = f.status(engine, kind)
        if f.served(engine) and st.state == REFUSED:
            for cls in f.vllm_specs if engine == "vllm" else f.sglang_pools:
                out[cls] = (f.feature, st.text)
    return out


def sglang_pools() -> Tuple[str, ...]:
    """The SGLang pool classes kvcached backs (of the families it serves on SGLang), once each."""
    seen: Dict[str, None] = {}
    for f in FAMILIES:
        if f.served("sglang"):
            seen.update(dict.fromkeys(f.sglang_pools))
    return tuple(seen)


def cases(engine: str) -> Dict[str, Case]:
    """The family engine test's parametrization on ``engine``: case id -> Case."""
    return {c.name: c for f in FAMILIES for c in f.cases if c.engine == engine}


# ------------------------------------------------------------ README's table


def _cpu_cell(engine: str, st: Status) -> str:
    if st.state == PROVEN:
        head = f"{'in CI' if st.ci else 'by hand'} ({', '.join(st.releases(engine))})"
    elif st.state == REFUSED:
        head = "refused at start-up, one line"
    elif st.state == NOT_RUN:
        head = "not run"
    else:
        head = ""
    return _with(head, st)


def _with(head: str, st: Status) -> str:
    cell = f"{head}: {st.text}" if head and st.text else head or st.text
    return f"{cell} (`{st.ref}`)" if st.ref else cell


def _gpu_part(f: Family, engine: str) -> str:
    """One engine's part of the GPU cell (the engine's name added where the parts differ)."""
    st = f.status(engine, "gpu")
    if st.state == REFUSED and st == f.status(engine, "cpu"):
        return "refused, as on the CPU"
    if st.state == PROVEN:
        return _with(", ".join(st.releases(engine)), st)
    if st.state == REFUSED:
        return _with("**refused** at start-up, one line", st) + "; `KVCACHED_ALLOW_UNSUPPORTED=1` tries it anyway"
    return _with("not yet run" if st.state == NOT_RUN else "", st)


def _gpu_cell(f: Family) -> str:
    parts = [(e, _gpu_part(f, e)) for e in ENGINES]
    if len({p for _, p in parts}) == 1 and f.status(ENGINES[0], "gpu").state != PROVEN:
        return parts[0][1]
    return "; ".join(f"{ENGINE_NAMES[e]}{' ' if f.status(e, 'gpu').state == PROVEN else ': '}{p}" for e, p in parts)


README_HEADER = ("family", "vLLM (CPU engine)", "SGLang (CPU engine)", "GPU (lent H200 or H100)")


def readme_rows() -> List[Tuple[str, ...]]:
    """README's family table, one row per family; neighbours whose cells are all the
    same (the families refused everywhere) share one row."""
    rows: List[Tuple[str, ...]] = []
    for f in FAMILIES:
        cells = (_cpu_cell("vllm", f.vllm_cpu), _cpu_cell("sglang", f.sglang_cpu), _gpu_cell(f))
        if rows and rows[-1][1:] == cells:
            rows[-1] = (f"{rows[-1][0]}, {f.name}", *cells)
        else:
            rows.append((f.name, *cells))
    return rows


README_START = (
    "<!-- family table: generated by kvcached/integration/families.py"
    " (tests/integration/test_families.py checks it) -->"
)
README_END = "<!-- end of family table -->"


def readme_section() -> str:
    """The block README carries between its markers: the family table as Markdown
    (``python3 kvcached/integration/families.py readme`` prints it)."""
    lines = [README_START, "| " + " | ".join(README_HEADER) + " |", "|" + "---|" * len(README_HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in readme_rows()]
    return "\n".join([*lines, README_END])


if __name__ == "__main__":
    if sys.argv[1:] != ["readme"]:
        sys.exit("usage: families.py readme")
    print(readme_section())
