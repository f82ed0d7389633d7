#!/usr/bin/env bash
# The GPU engine proof (issue: vLLM on the H200 with kvcached), on any CUDA machine whose
# python3 has vLLM and kvcached (on the lent H200: source scripts/gpu_device_install.sh first).
#   suite        the test suite with the CUDA backend and the data-plane benchmarks
#                (scripts/gpu_suite.sh --ignore=tests/engines), alone in its group: a test reads
#                the device's used memory and the benchmarks time it (beside `model` on 12-06,
#                test_two_instances_share_one_gpu saw the model step's 3 GiB)
#   model        random-weight Llama-3-8B and Llama-3.2-1B shapes in bf16, drawn on the GPU,
#                word-level tokenizer (kvcached.testing.tiny_model --preset), and a small
#                DeepSeek-V2 (MLA) with the latent sizes GPU kernels take, a small
#                Qwen3-Next, and small Gemma 3 / Gemma 4 (heads of 128, Gemma 4's global ones 256,
#                6 layers, window 512) (tiny_families)
#   limits       kvctl limit lowered while decoding (at or under it within 1 s), raised again
#   correctness  greedy tokens with and without kvcached, vLLM defaults, KV large enough that
#                nothing is evicted, and a second native engine as the control
#   correctness-limit
#                the same with batch-invariant kernels and a kvcached limit a third of the
#                load's need: preemption and eviction all the time (the release-fence test); the
#                control that decides is native-held (kvcached-limit's tensor size and block count)
#   offload      correctness with vLLM's KV offloading on every engine (--kv-offloading-size 16):
#                stores to host under kvcached's fence; offload-limit: the same under the
#                correctness-limit pressure, evicted prefixes loaded back from host (issue 32)
#   offload-idle A (8B, vLLM) serves 32 prompts sharing a 7680-token prefix, goes idle; B's burst takes
#                the shared KV budget (A gives its pages back); A asked again: TTFT and prefix hits with
#                the host tier (--kv-offloading-size) vs without (recompute) vs native static pools;
#                mapped KV and host-tier bytes over time ($OUT/gpu_offload_idle.png; issue 32 item 4)
#   mla          the MLA model: native vs kvcached, and a second native as the control
#   mla-limit    the MLA model with batch-invariant kernels (vLLM 0.26 has them for MLA) and a
#                kvcached limit small enough that preemption and eviction run all the time; the
#                control is native with kvcached-limit's very block count and tensor size (native-held;
#                MLA's recompute is not bit-equal), on 18 MiB pages every block divides (see the step)
#   hybrid       the same as mla for a small Qwen3-Next (gated-delta-net state and attention KV in
#                one elastic pool), and native-dirty (native whose KV memory starts as noise, as a
#                fresh kvcached page does); vLLM's kvcached refuses it on a GPU until it matches native
#                on the H200 too, so the vLLM hybrid steps serve it with KVCACHED_ALLOW_UNSUPPORTED=1
#   hybrid-eager, hybrid-sync
#                the same pair without CUDA graphs / without async scheduling: which one the
#                2026-12-04 difference (docs/GPU.md) needs
#   hybrid-ro    the hybrid pair with kvcached's zero page read-only (KVCACHED_ZERO_PAGE=ro): a kernel
#                writing where no page is mapped faults instead of changing what unmapped memory reads
#   hybrid-real  a Qwen3-Next with the real model's layer shapes (float32 state: a block larger than
#                the 2 MiB page) served without KVCACHED_PAGE_SIZE: the page is chosen from the spec
#   hybrid-limit the Qwen3-Next under a small limit, bfloat16 with float32 state (vLLM's GDN prefill
#                takes no float32 input and has no batch-invariant kernels: the control decides;
#                34 MiB pages, which its 272 KiB blocks divide)
#   gemma3       the same as mla for a small Gemma 3 (sliding-window + global layers: vLLM's
#                several KV cache groups in one pool, window blocks leaving as outputs of up to
#                2,400 tokens cross the 512-token window); gemma3-limit: the same under a 512M limit
#                (batch-invariant kernels, native-small the control that decides); gemma3-limit-ro,
#                -eager, -sync, -loose: the same with a read-only zero page / without CUDA graphs /
#                without async scheduling / with a limit that never binds (which one the
#                2026-12-05 difference needs)
#   gemma4       the same for a small Gemma 4 (global layers of head size 256 beside local ones of
#                128: KV specs of different page sizes); gemma4-limit under a 768M limit
#   fp8          the Llama-3.2-1B shape with an FP8 KV cache (kv_cache_dtype fp8_e4m3, 1-byte
#                cells): native vs kvcached vs native-2, 3G of KV each; fp8-limit under a 1G limit
#                with native-small (issue 29 item 4)
#   overhead     vllm bench serve native vs kvcached (and a kvcached that keeps emptied pages
#                mapped), paired rounds, up to saturation; map/unmap calls and their time
#   three        three models, one budget vs a static split; TTFT and want -> give-back; 3 rounds
#                of bursts on one start-up (KVCACHED_PROOF_THREE_ROUNDS), p99 per round;
#                three-margin: 6208M (6G and the idle peers' null pages), three-small: 3G,
#                three-keep: 6G with KVCACHED_KEEP_NULL_PAGE=true (idle peers keep their null
#                block's page, as before 12-06: the A/B of an idle give-back that releases it)
#   router       three models behind `kvcached serve`: sleep when idle, wake on request
#   borrow       a training job (1B-shaped, bf16, AdamW) borrows 40 GiB from a vLLM server between its
#                bursts (torch_alloc_retry meets a real OOM first) vs a static split of 64 GiB
# SGLang (0.5.17, its own site directory: PYTHONPATH=/tmp/sc-sglang, scripts/gpu_device_install.sh),
# `python -m sglang.launch_server` unchanged with its defaults (CUDA graphs, overlap scheduler,
# radix cache, FA3 on the H200):
#   sglang-correctness      the 8B model: native vs kvcached vs native-2, page size 1
#   sglang-correctness-p16  the same at page size 16
#   sglang-correctness-limit
#                deterministic inference, kvctl limit 6G (a third of the load's need): retraction
#                and radix eviction all the time; the control is native with a pool that small
#   sglang-hicache          sglang-correctness-limit with --enable-hierarchical-cache (write_through,
#                a 16 GB host pool) on every engine: pages evicted under the 6G limit go to host
#                memory and prefix hits load back; the control is native with a pool that small
#   sglang-limits           kvctl limit lowered while decoding, raised again
#   sglang-overhead         sglang.bench_serving native vs kvcached, paired rounds
#   sglang-mla              the MLA model: native vs kvcached vs native-2
#   sglang-gemma3           the Gemma 3 model: native vs kvcached vs native-2 (SGLang serves Gemma 3
#                from one pool, the window a mask)
#   sglang-fp8              the 1B model with --kv-cache-dtype fp8_e4m3: native vs kvcached vs native-2
#   sglang-hybrid           the Qwen3-Next model (SGLang's layout), served by default since its 12-07 run:
#                native vs kvcached vs native-2
#   sglang-gemma3-limit, sglang-fp8-limit
#                the two above under a kvctl limit of a quarter to a third of the load's need
#                (deterministic inference; native-small, native with the limit's tokens, the control)
# Both engines (each its own site directory: both sets copied):
#   mixed        a vLLM and an SGLang server sharing one KV budget, bursts alternating between
#                them, vs a static split of the same memory; want -> give-back both ways
#   router-mixed a vLLM and an SGLang model behind `kvcached serve` (kv sleep, wake on request)
# More models than the GPU holds (vLLM; SGLang):
#   sleep-engine more copies of the 8B model than the GPU holds behind `kvcached serve` with
#                `sleep: engine` (vLLM's sleep mode, kvcached gives the KV back) and max_awake
#                (sleep_engine.py: rotating and Zipf streams, wake p50/p99, TTFT, greedy tokens
#                after wakes = before); sleep-engine-stop the same with `sleep: stop` (restarts;
#                fewer models, the wake is a restart either way), printed beside sleep-engine's
#   sglang-sleep-engine  sleep-engine with SGLang 0.5.17 (`--enable-memory-saver
#                --enable-weights-cpu-backup`: torch_memory_saver moves the weights to host memory
#                and back, kvcached the KV), printed beside vLLM's sleep-engine;
#                sglang-sleep-engine-retain the same with TMS_RETAIN_CPU_BACKUP=1 (torch_memory_saver
#                keeps each host copy across cycles), printed beside sglang-sleep-engine
#   sleep-small, sglang-sleep-small  the token check after wakes and the sleeps in less device
#                time: two models, one awake, three rounds (every visit a wake after the other
#                model's sleep); sglang-sleep-small-retain with TMS_RETAIN_CPU_BACKUP=1, printed
#                beside sglang-sleep-small (same session, after it)
# Usage: bash scripts/gpu_engines.sh [step ...]   (default: every step, in this order)
#   STEP@SET runs STEP with engine set SET's site directory (PYTHONPATH=/tmp/sc-SET, e.g.
#   correctness@vllm029: vLLM 0.29); STEP.N is STEP again under its own name (tables, work folder),
#   so one step can be repeated in one session (hybrid-ro hybrid-ro.2; both: gemma4.2@vllm029).
#   STEP@SET-REV runs it with an earlier commit's kvcached (scripts/gpu_pack_tree.sh REV; one that
#   refuses the model says so in one line: KVCACHED_ALLOW_UNSUPPORTED=1 before the command reaches it).
#   STEP-trace runs STEP with KVCACHED_TRACE=$OUT/trace-STEP, then prints its burst timelines
#   (python -m kvcached.bench burst) to $OUT/STEP-burst.txt (three-trace, mixed-trace: issue 30).
#   KVCACHED_VLLM_PYTHONPATH
#   names the vLLM set of every vLLM step (default: the PYTHONPATH this script was given).
# Logs and JSON go to a work folder (KVCACHED_PROOF_WORK, default /tmp/kvcached-proof); each
# step's table to $OUT/<step>.txt and its files to $OUT/<step>.tgz (a device call brings back
# few files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
WORK="${KVCACHED_PROOF_WORK:-/tmp/kvcached-proof}"
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(model limits correctness correctness-limit mla mla-limit hybrid hybrid-limit overhead three router)
big="$WORK/models/llama3-8b"
small="$WORK/models/llama3-1b"
mla="$WORK/models/deepseek-v2-mla"
hybrid="$WORK/models/qwen3-next"
hybrid_real="$WORK/models/qwen3-next-real"
hybrid_sglang="$WORK/models/qwen3-next-sglang"  # SGLang's layout: every layer MoE, attention by interval
gemma3="$WORK/models/gemma3"
gemma4="$WORK/models/gemma4"
proof=scripts/gpu_proof
sglang_path=${KVCACHED_SGLANG_PYTHONPATH:-/tmp/sc-sglang}
vllm_path=${KVCACHED_VLLM_PYTHONPATH:-/tmp/sc-vllm}
both=(--vllm-path "$vllm_path" --sglang-path "$sglang_path")
[ -n "${KVCACHED_VLLM_PYTHONPATH:-}" ] && export PYTHONPATH=$KVCACHED_VLLM_PYTHONPATH
gdn='{"additional_config": {"gdn_prefill_backend": "triton"}}'
fp8='{"kv_cache_dtype": "fp8_e4m3"}'
# Rounds of the three-model steps on one start-up of their six servers (issue 30 item 3: 3+ runs).
three_rounds=${KVCACHED_PROOF_THREE_ROUNDS:-3}
rc=0
# run STEP SCRIPT ARGS...: the step's script with its work folder, its table to $OUT/STEP.txt.
run() {
  local step=$1 script=$2
  shift 2
  python3 "$script" --out "$WORK/$step" "$@" 2>&1 | tee "$OUT/$step.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
}
# fits GIB: how many engines of GIB each this card holds side by side (at least 1): three 8B
# engines with 22 GiB of KV (~40 GiB each) fit an H200, one an H100.
fits() {
  local mib
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  echo $(( ${mib:-0} / 1024 / $1 > 1 ? ${mib:-0} / 1024 / $1 : 1 ))
}
# run_sglang STEP SCRIPT ARGS...: the same with SGLang's site directory on the path.
run_sglang() { PYTHONPATH=$sglang_path run "$@"; }
for step in "${steps[@]}"; do
  echo "== $(date -Is) $step" | tee -a "$OUT/steps.txt"
  t0=$(date +%s)
  base=${step%@*} && base=${base%.[0-9]*} && given_path=${PYTHONPATH-}
  [ "${step#*@}" != "$step" ] && export PYTHONPATH=/tmp/sc-${step#*@}
  traced=
  if [ "${base%-trace}" != "$base" ]; then
    base=${base%-trace} traced=$OUT/trace-$step
    export KVCACHED_TRACE=$traced
  fi
  case "$base" in
    suite) OUT="$OUT/suite" bash scripts/gpu_suite.sh --ignore=tests/engines > "$OUT/suite.log" 2>&1 || rc=1
      { grep -E "passed|failed" "$OUT/suite/pytest.log" | tail -3; tail -n 4 "$OUT"/suite/bench_*.txt; } > "$OUT/suite.txt" ;;
    model)
      for m in "$big:llama3-8b" "$small:llama3-1b"; do
        dir=${m%%:*}
        [ -f "$dir/config.json" ] || python3 -m kvcached.testing.tiny_model "$dir" --preset "${m##*:}" \
          --device cuda --dtype bfloat16 --layers-per-shard 4 || rc=1
      done
      [ -f "$mla/config.json" ] || python3 -m kvcached.testing.tiny_families deepseek_v2 "$mla" \
        --gpu-shapes --vocab-size 32000 || rc=1
      [ -f "$hybrid/config.json" ] || python3 -m kvcached.testing.tiny_families qwen3_next "$hybrid" \
        --gpu-shapes --vocab-size 32000 || rc=1
      [ -f "$hybrid_real/config.json" ] || python3 -m kvcached.testing.tiny_families qwen3_next "$hybrid_real" \
        --real-shapes --vocab-size 32000 || rc=1
      [ -f "$hybrid_sglang/config.json" ] || python3 -m kvcached.testing.tiny_families qwen3_next "$hybrid_sglang" \
        --gpu-shapes --sglang --vocab-size 32000 || rc=1
      for m in "$gemma3:gemma3" "$gemma4:gemma4"; do
        dir=${m%%:*}
        [ -f "$dir/config.json" ] || python3 -m kvcached.testing.tiny_families "${m##*:}" "$dir" \
          --gpu-shapes --vocab-size 32000 --sliding-window 512 || rc=1
      done
      # vLLM 0.26 loads Gemma 4 only with a transformers before per-layer head sizes (5.24 refuses
      # config.head_dim: AmbiguousGlobalPerLayerAttributeError): the version says which the image has.
      python3 -c 'import transformers; print("transformers", transformers.__version__)' | tee -a "$OUT/steps.txt"
      du -sh "$WORK/models"/* | tee -a "$OUT/steps.txt" ;;
    limits) run "$step" $proof/limits.py --model "$big" ;;
    # 200 prompts need 18.9 GiB of KV if nothing is ever evicted: 22G each.
    correctness) run "$step" $proof/correctness.py --model "$big" --prompts 200 --kv 22G \
      --only native,kvcached,native-2 --control --at-once "$(fits 42)" ;;
    # native-held decides under a limit: kvcached-limit's block count out of tensors of kvcached-limit's
    # size. On 12-06 11:27 (vLLM 0.29, H100) native-small gave tokens other than kvcached-limit's from
    # step 1 with one schedule, and other than native-small-2's in none: both small natives had loaded
    # their compiled graph from the cache, kvcached-limit compiled its own (kernel configs picked per
    # process: PINNED_KERNELS, pinned since).
    correctness-limit) run "$step" $proof/correctness.py --model "$big" --prompts 200 \
      --only native-bi,kvcached-limit,native-held,native-small --control --at-once "$(fits 30)" ;;
    # vLLM's native KV offloading (--kv-offloading-size) on every engine: the copies are fenced
    # (kvcached/integration/vllm/offload.py). offload: no pressure (stores only); offload-limit: the
    # kvcached limit a third of the need, so evicted prefixes come back from the host tier (loads).
    offload) run "$step" $proof/correctness.py --model "$big" --prompts 200 --kv 22G \
      --only native,kvcached,native-2 --control --at-once "$(fits 42)" --engine-args '{"kv_offloading_size": 16}' ;;
    offload-limit) run "$step" $proof/correctness.py --model "$big" --prompts 200 \
      --only native-bi,kvcached-limit,native-held,native-small --control --at-once "$(fits 30)" \
      --engine-args '{"kv_offloading_size": 16}' ;;
    # KVCACHED_PROOF_ARMS: some of native,recompute,offload (one device call each if they take long;
    # the arms measured earlier with the same settings are kept in the table and the plot).
    offload-idle) run "$step" $proof/offload_idle.py --model "$big" --plot "$OUT/gpu_offload_idle.png" \
      --only "${KVCACHED_PROOF_ARMS:-native,recompute,offload}" ;;
    mla) run "$step" $proof/correctness.py --model "$mla" --prompts 200 --kv 2G --only native,kvcached,native-2 --control ;;
    # A limit run decides only where kvcached-limit and its native control make the same decisions on
    # tensors of the same size (native-held). MLA's 1,152-byte rows (x block tokens) and the tiny
    # Qwen3-Next's 272 KiB blocks do not divide a 2 MiB page: some pages hold fewer blocks, and under
    # a limit kvcached's free count is the worst case of which pages map next, so the schedules
    # differed from step 0 (12-04, 12-05). MLA: an 18 MiB page (9 x 2 MiB), 2016M (whole pages of its
    # 4 layers) gave one schedule on 12-06: at 11:27 native-small differed in 65 of 200 from step 5
    # (its own kernel configs: at 14:48, with the same tokens from kvcached-limit, in none), native-bi
    # (unlimited, another schedule) in 3, each after a recompute.
    mla-limit) KVCACHED_PAGE_SIZE=18874368 run "$step" $proof/correctness.py --model "$mla" --prompts 200 \
      --kv 2016M --limit 216M --only native-bi,kvcached-limit,native-held,native-small --control ;;
    # vLLM 0.26 picks FlashInfer's GDN prefill on SM90, whose CuTe DSL kernel this image lacks:
    # Triton's. One GDN state block per running sequence, which CUDA graph capture wants for every
    # one of max_num_seqs: a 256 MiB pool holds 455 (tiny model), 4 GiB 992 real-shape ones: 256.
    hybrid) run "$step" $proof/correctness.py --model "$hybrid" --allow-unsupported --prompts 200 --kv 2G \
      --only native,kvcached,native-2,native-dirty --control --engine-args "$gdn" ;;
    hybrid-eager|hybrid-sync)
      [ "$base" = hybrid-eager ] && knob='"enforce_eager": true' || knob='"async_scheduling": false'
      run "$step" $proof/correctness.py --model "$hybrid" --allow-unsupported --prompts 200 --kv 2G \
        --only native,kvcached --engine-args "${gdn%\}}, $knob}" ;;
    hybrid-ro) KVCACHED_ZERO_PAGE=ro run "$step" $proof/correctness.py --model "$hybrid" --allow-unsupported --prompts 200 \
      --kv 2G --only native,kvcached --engine-args "$gdn" ;;
    hybrid-real) unset KVCACHED_PAGE_SIZE  # the point: no page-size variable
      run "$step" $proof/correctness.py --model "$hybrid_real" \
      --allow-unsupported --prompts 100 --kv 4G --only native,kvcached,native-2 --control \
      --mamba-ssm-cache-dtype float32 --engine-args "${gdn%\}}, \"max_num_seqs\": 256}" ;;
    # The hybrid: 34 MiB pages (17 x 2 MiB: 128 blocks of 272 KiB; 18 MiB held 66 or 67 on 12-06),
    # 2040M (30 pages of each of its 2 tensors), 272M (4 pages each: 512 blocks, above the 256
    # sequences CUDA graphs want a state block for).
    hybrid-limit) KVCACHED_PAGE_SIZE=35651584 run "$step" $proof/correctness.py --model "$hybrid" --allow-unsupported \
      --prompts 200 --kv 2040M --limit 272M --only native,kvcached-limit,native-held,native-small --control --no-batch-invariant \
      --mamba-ssm-cache-dtype float32 --engine-args "${gdn%\}}, \"max_num_seqs\": 256}" ;;
    # Issue 29 item 4. Gemma 3 / 4 (GPU shapes): 200 prompts allocate ~1.8 / ~2.4 GiB of blocks over the
    # run (window blocks leave and stay cached), 4G each: nothing evicted; the limits about a third of
    # what is live at once. FP8: the 1B shape's 16 KiB a token in fp8, 200 prompts ~2.4 GiB: 3G each.
    # Sliding-window layers were refused on a GPU from 12-05 (one gemma3-limit run differed) to 12-06 (five identical).
    gemma3|gemma4)
      [ "$base" = gemma3 ] && model=$gemma3 || model=$gemma4
      run "$step" $proof/correctness.py --model "$model" --prompts 200 --kv 4G \
        --only native,kvcached,native-2 --control ;;
    gemma3-limit|gemma4-limit)
      [ "$base" = gemma3-limit ] && model=$gemma3 lim=512M || model=$gemma4 lim=768M
      run "$step" $proof/correctness.py --model "$model" --prompts 200 --kv 4G --limit "$lim" \
        --only native-bi,kvcached-limit,native-held,native-small --control ;;
    # Which gemma3-limit's difference needs (175 of 200 with native-small's very schedule, H100 12-05; one
    # sequence already at its first token, before any block was freed): a read-only zero page (a kernel
    # writing where nothing is mapped faults), no CUDA graphs, no async scheduling, or a limit that never
    # binds (batch-invariant kernels with kvcached, nothing unmapped: native-small is then native-bi).
    gemma3-limit-ro|gemma3-limit-eager|gemma3-limit-sync|gemma3-limit-loose)
      zp=${KVCACHED_ZERO_PAGE:-rw} knob= lim=512M
      case "$base" in
        *-ro) zp=ro ;;
        *-eager) knob='{"enforce_eager": true}' ;;
        *-sync) knob='{"async_scheduling": false}' ;;
        *-loose) lim=4G ;;
      esac
      KVCACHED_ZERO_PAGE=$zp run "$step" $proof/correctness.py --model "$gemma3" --prompts 200 \
        --kv 4G --limit "$lim" --only native-bi,kvcached-limit,native-held,native-small --control ${knob:+--engine-args "$knob"} ;;
    fp8) run "$step" $proof/correctness.py --model "$small" --prompts 200 --kv 3G \
      --only native,kvcached,native-2 --control --engine-args "$fp8" ;;
    fp8-limit) run "$step" $proof/correctness.py --model "$small" --prompts 200 --kv 3G --limit 1G \
      --only native-bi,kvcached-limit,native-held,native-small --control --engine-args "$fp8" ;;
    # KVCACHED_PROOF_VARIANTS: more kvcached servers measured beside the two (empty: none).
    overhead)
      variants=()
      for v in ${KVCACHED_PROOF_VARIANTS-keep:KVCACHED_MAX_RESERVED_PAGES=700}; do variants+=(--variant "$v"); done
      run "$step" $proof/overhead.py --model "$big" --kv 24G --inf-requests 256 --rates "${KVCACHED_PROOF_RATES:-8,32,inf}" \
        --rounds "${KVCACHED_PROOF_ROUNDS:-4}" --seconds 10 "${variants[@]}" ;;
    three) run "$step" $proof/three_models.py --model "$small" --rounds "$three_rounds" --plot "$OUT/gpu_three_models.png" ;;
    # three with the 64 MiB two idle peers' null-block pages hold added to the budget: at 6 GiB the
    # 192 prompts need it all, 3 waited (docs/GPU.md 12-05 23:51): does the p99 follow that margin?
    # three-small: a budget far under the burst (3G), where kvcached beat the split at p99.
    three-margin|three-small)
      [ "$base" = three-margin ] && kv=6208M || kv=3G
      run "$step" $proof/three_models.py --model "$small" --kv "$kv" --rounds "$three_rounds" --plot "$OUT/gpu_$step.png" ;;
    three-keep) KVCACHED_KEEP_NULL_PAGE=true run "$step" $proof/three_models.py --model "$small" \
      --rounds "$three_rounds" --plot "$OUT/gpu_$step.png" ;;
    router) run "$step" $proof/router_three.py --model "$small" --plot "$OUT/gpu_router_three.png" ;;
    borrow) run "$step" $proof/borrow_train.py --model "$small" --total "${KVCACHED_PROOF_TOTAL:-64G}" --borrow "${KVCACHED_PROOF_BORROW:-40G}" --plot "$OUT/gpu_borrow_train.png" ;;
    sglang-correctness) run_sglang "$step" $proof/sglang_correctness.py --model "$big" --prompts 200 --kv 22G \
      --only native,kvcached,native-2 ;;
    sglang-correctness-p16) run_sglang "$step" $proof/sglang_correctness.py --model "$big" --prompts 200 --kv 22G \
      --page-size 16 --only native,kvcached,native-2 ;;
    sglang-correctness-limit) run_sglang "$step" $proof/sglang_correctness.py --model "$big" --prompts 200 --kv 22G \
      --limit 6G --only native-det,kvcached-limit,native-small ;;
    sglang-hicache) run_sglang "$step" $proof/sglang_correctness.py --model "$big" --prompts 200 --kv 22G \
      --limit 6G --only native-det,kvcached-limit,native-small -- --enable-hierarchical-cache --hicache-size 16 \
      --hicache-write-policy write_through ;;
    sglang-limits) run_sglang "$step" $proof/limits.py --engine sglang --model "$big" ;;
    # KVCACHED_PROOF_VARIANTS here: none unless set (e.g. premapped:KVCACHED_MIN_RESERVED_PAGES=64,...).
    sglang-overhead)
      variants=()
      for v in ${KVCACHED_PROOF_VARIANTS-}; do variants+=(--variant "$v"); done
      run_sglang "$step" $proof/overhead.py --engine sglang --model "$big" --kv "${KVCACHED_PROOF_KV:-24G}" --inf-requests 256 \
        --rates "${KVCACHED_PROOF_RATES:-8,32,inf}" --rounds "${KVCACHED_PROOF_ROUNDS:-4}" --seconds 10 "${variants[@]}" ;;
    sglang-mla) run_sglang "$step" $proof/sglang_correctness.py --model "$mla" --prompts 200 --kv 2G \
      --only native,kvcached,native-2 ;;
    # One pool of all 6 layers (12 KiB a token): 3G holds the 200 prompts' ~176k tokens.
    sglang-gemma3) run_sglang "$step" $proof/sglang_correctness.py --model "$gemma3" --prompts 200 --kv 3G \
      --only native,kvcached,native-2 ;;
    # --kv counts bf16 bytes (--max-total-tokens from the model's bf16 row): 6G = 196k tokens, 3 GiB in fp8.
    sglang-fp8) run_sglang "$step" $proof/sglang_correctness.py --model "$small" --prompts 200 --kv 6G \
      --only native,kvcached,native-2 -- --kv-cache-dtype fp8_e4m3 ;;
    # The 200 prompts need ~176k tokens: 512M holds 43k of Gemma 3's (12 KiB each, as gemma3-limit's
    # 512M on vLLM), 1G of FP8 KV 64k of the 1B's (16 KiB each).
    sglang-gemma3-limit) run_sglang "$step" $proof/sglang_correctness.py --model "$gemma3" --prompts 200 --kv 3G \
      --limit 512M --only native-det,kvcached-limit,native-small ;;
    sglang-fp8-limit) run_sglang "$step" $proof/sglang_correctness.py --model "$small" --prompts 200 --kv 6G \
      --limit 1G --only native-det,kvcached-limit,native-small -- --kv-cache-dtype fp8_e4m3 ;;
    # SGLang's hybrid state is served on a GPU since this run was identical (12-07, families.py): by
    # default here. vLLM's tiny Qwen3-Next does not load in SGLang (no full_attention_interval; dense MLPs).
    sglang-hybrid) run_sglang "$step" $proof/sglang_correctness.py --model "$hybrid_sglang" --prompts 200 \
      --kv 2G --only native,kvcached,native-2 ;;
    mixed) PYTHONPATH=$vllm_path run "$step" $proof/mixed_engines.py --model "$small" "${both[@]}" \
      --plot "$OUT/gpu_mixed_engines.png" ;;
    router-mixed) PYTHONPATH=$vllm_path run "$step" $proof/router_three.py --model "$small" \
      --models A=vllm:kv,B=sglang:kv "${both[@]}" --plot "$OUT/gpu_router_mixed.png" ;;
    sleep-engine|sleep-engine-stop)
      if [ "$base" = sleep-engine ]; then more=(--sleep engine); else more=(--sleep stop --models 4 --max-awake 2 --zipf-seconds 30); fi
      run "$step" $proof/sleep_engine.py --model "$big" "${more[@]}" --compare "$WORK/sleep-engine/sleep_engine.json" \
        --plot "$OUT/gpu_sleep_engine.png" ;;
    sglang-sleep-engine) run_sglang "$step" $proof/sleep_engine.py --engine sglang --model "$big" --sleep engine \
      --compare "$WORK/sleep-engine/sleep_engine.json" --plot "$OUT/gpu_sleep_engine_sglang.png" ;;
    # 12-06: every release took 5.3 s (a fresh pinned host copy each time?): the same with the copy kept.
    sglang-sleep-engine-retain) run_sglang "$step" $proof/sleep_engine.py --engine sglang --model "$big" --sleep engine \
      --engine-env TMS_RETAIN_CPU_BACKUP=1 --compare "$WORK/sglang-sleep-engine/sleep_engine.json" \
      --plot "$OUT/gpu_sleep_engine_sglang_retain.png" ;;
    # The sleeps after a model's first and the tokens after each wake decide these: two models,
    # one awake, so that each of the six visits wakes one after the other's sleep (the weights
    # need not exceed the GPU for that).
    sleep-small|sglang-sleep-small|sglang-sleep-small-retain)
      sleep_args=(--model "$big" --sleep engine --models 2 --max-awake 1 --rounds 3 --rate 1 --zipf-seconds 20
        --plot "$OUT/gpu_${base//-/_}.png")
      case "$base" in
        sleep-small) run "$step" $proof/sleep_engine.py "${sleep_args[@]}" ;;
        sglang-sleep-small) run_sglang "$step" $proof/sleep_engine.py --engine sglang "${sleep_args[@]}" ;;
        *) run_sglang "$step" $proof/sleep_engine.py --engine sglang "${sleep_args[@]}" --engine-env TMS_RETAIN_CPU_BACKUP=1 \
          --compare "$WORK/sglang-sleep-small/sleep_engine.json" ;;
      esac ;;
    *) echo "unknown step $step (suite model limits correctness correctness-limit offload offload-limit offload-idle mla mla-limit hybrid hybrid-eager hybrid-sync hybrid-ro hybrid-real hybrid-limit gemma3 gemma3-limit gemma3-limit-ro gemma3-limit-eager gemma3-limit-sync gemma3-limit-loose gemma4 gemma4-limit fp8 fp8-limit overhead three three-margin three-small three-keep router borrow sglang-correctness sglang-correctness-p16 sglang-correctness-limit sglang-hicache sglang-limits sglang-overhead sglang-mla sglang-gemma3 sglang-gemma3-limit sglang-fp8 sglang-fp8-limit sglang-hybrid mixed router-mixed sleep-engine sleep-engine-stop sglang-sleep-engine sglang-sleep-engine-retain sleep-small sglang-sleep-small sglang-sleep-small-retain)" >&2
       exit 2 ;;
  esac
  export PYTHONPATH=$given_path
  if [ -n "$traced" ]; then
    unset KVCACHED_TRACE
    python3 -m kvcached.bench burst --trace "$traced" > "$OUT/$step-burst.txt" 2>&1 || rc=1
    tar czf "$OUT/trace-$step.tgz" -C "$OUT" "trace-$step" && rm -rf "$traced"
  fi
  echo "== $step: $(( $(date +%s) - t0 )) s, rc so far $rc" | tee -a "$OUT/steps.txt"
  [ -d "$WORK/$step" ] && tar czf "$OUT/$step.tgz" -C "$WORK" --exclude='prompts.json' "$step"
done
exit $rc
