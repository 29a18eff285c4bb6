#!/usr/bin/env bash
# Issue 44's throughput figures on one GPU, part by part, each under its own time limit, printed as measured:
#   side_by_side  arcface_torch's train_v2.py and train.py on one config file: samples/s and the ratio
#            (gpu_acceptance/side_by_side.py; its arcface_torch folder and wheels prepared in .side-by-side/, docs/gpu.md)
#   split    bench_train --split: r50 at one and two views, images/s, the step split, MFU, channels_last and bf16
#            on and off, the optimizer's kernels
#   vit_b    the same for vit_b (bf16 on and off)
#   compile  r50 with compile_backbone, without and with CUDA graphs (cold: minutes of compilation per row,
#            cached in TORCHINDUCTOR_CACHE_DIR for a second call)
#   pfc      bench_pfc at 1M and 4M classes, fp16, each time beside its floor, eager and with compile_margin_softmax
#            (--compile: its compile seconds beside); then --step (SGD included)
# Part names given as arguments run those parts only; by default all of them. On one H200, three calls of at most
# 10 minutes each: side_by_side split, then vit_b pfc, then compile (docs/gpu.md). Needs what gpu_acceptance/gpu_check.sh needs (its wheels).
#
#   bash gpu_acceptance/gpu_throughput.sh                 # on a machine with a GPU
#   bash gpu_acceptance/gpu_throughput.sh --tiny          # the same commands on this CPU at tiny shapes: a rehearsal
#   bash gpu_acceptance/gpu_throughput.sh compile         # one part
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
tiny=() parts=()
for argument in "$@"; do
    if [ "$argument" = "--tiny" ]; then tiny=(--tiny); else parts+=("$argument"); fi
done
known=(side_by_side split vit_b compile pfc)
names="${known[*]}"
[ ${#parts[@]} -gt 0 ] || parts=("${known[@]}")
for part in "${parts[@]}"; do
    if [[ " ${known[*]} " != *" $part "* ]]; then
        echo "gpu throughput: unknown part '$part'; the parts are ${names// /, }" >&2
        exit 2
    fi
done

. provision/gpu_prepare.sh
if [ ${#tiny[@]} = 0 ]; then
    side_by_side=(--arcface-torch .side-by-side/arcface_torch)
    split=(--split --device cuda --width-mult 1 --embedding-size 512 --batch-size 128 --classes 100000 --fp16
           --steps 20)
    pfc=(--device cuda --fp16 --classes 1000000 4000000)
    scale=1
else
    side_by_side=(--tiny --arcface-torch .side-by-side/arcface_torch)
    split=(--split --tiny)
    pfc=(--classes 2000 8000 --threads 1)
    scale=4  # a loaded CPU is slower than an H200
fi

failed=()
run_part() {  # name, seconds on one H200, command
    local name=$1 seconds=$(($2 * scale))
    shift 2
    echo "== $name (limit ${seconds} s): $*"
    local start=$SECONDS status=0
    timeout --kill-after=10 "$seconds" "$PY" -m "$@" || status=$?
    if [ "$status" != 0 ]; then
        echo "== $name: exit status $status$([ "$status" = 124 ] && echo ", stopped at its limit")"
        failed+=("$name")
    fi
    echo "== $name: $((SECONDS - start)) s"
}

for part in "${parts[@]}"; do
    case $part in
        side_by_side)
            if [ -d .side-by-side/arcface_torch ]; then
                PYTHONPATH="$PWD/.side-by-side/site:$PYTHONPATH" run_part side_by_side 240 gpu_acceptance.side_by_side \
                    "${side_by_side[@]}"
            else
                echo "== side_by_side: not run: no .side-by-side/arcface_torch here (docs/gpu.md says how to prepare it)"
                failed+=(side_by_side)
            fi ;;
        split) run_part split 240 bench.bench_train "${split[@]}" --networks r50 --views 1 2 \
                   --switches channels_last bf16 ;;
        vit_b) run_part vit_b 120 bench.bench_train "${split[@]}" --networks vit_b --views 1 2 --switches bf16 ;;
        compile) run_part compile 540 bench.bench_train "${split[@]}" --networks r50 --views 1 2 \
                     --switches compile cudagraphs ;;
        pfc) run_part "pfc floor" 200 bench.bench_pfc --compile --rounds 1 "${pfc[@]}"
             run_part "pfc step" 120 bench.bench_pfc --step "${pfc[@]}" ;;
    esac
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu throughput: did not finish: ${failed[*]}"
    exit 1
fi
echo "gpu throughput: every part finished"
