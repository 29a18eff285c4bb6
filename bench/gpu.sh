#!/usr/bin/env bash
# GPU throughput check (under 8 minutes on one GPU): r50, fp16, batch 128 records.
#   1. training steps on random images already on the GPU (no decoding): one view vs two views,
#      samples/s and peak memory (bench/bench_train.py);
#   2. the same two-view run through train.py with the data decoded from a packed .rec
#      (tools/make_synthetic.py), samples/s as train.py logs it.
#
#   bash bench/gpu.sh                 # on a GPU machine
#   GPU_SH_TINY=1 bash bench/gpu.sh   # a CPU smoke test of the script itself (tiny network, few steps)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
WORK=${GPU_SH_WORK:-$(mktemp -d)}
export PYTHONUNBUFFERED=1

if [ -n "${GPU_SH_TINY:-}" ]; then
    DEVICE=cpu; NET=(--network r18 --width-mult 0.125 --embedding-size 64 --batch-size 4)
    STEPS=(--steps 2 --rounds 1); TRAIN_NET=("network=r18" "network_kwargs={'width_mult': 0.125}" "embedding_size=64")
    BATCH=4; TRAIN_STEPS=6; FREQUENT=2; IDS=40; WORKERS=1; FP16=False; FP16_FLAG=(); CLASSES=1000
else
    DEVICE=cuda; NET=(--network r50 --width-mult 1 --embedding-size 512 --batch-size 128)
    STEPS=(--steps 100 --rounds 2); TRAIN_NET=("network=r50" "network_kwargs={}" "embedding_size=512")
    BATCH=128; TRAIN_STEPS=300; FREQUENT=20; IDS=2000; WORKERS=8; FP16=True; FP16_FLAG=(--fp16); CLASSES=93431
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi

echo "== 1. synthetic images on the device (no decoding): one view vs two views =="
"$PY" bench/bench_train.py --device "$DEVICE" "${NET[@]}" "${FP16_FLAG[@]}" --classes "$CLASSES" "${STEPS[@]}" --modes ab

echo "== 2. two views decoded from a packed .rec by train.py ($TRAIN_STEPS steps) =="
"$PY" tools/make_synthetic.py --output "$WORK/data" --identities "$IDS" --images-per-identity 8 --views 2 \
    --val-identities 20 --val-pairs 40 --workers "$(nproc)" --overwrite
"$PY" train.py configs/synthetic_pair.py --set "rec=$WORK/data" --set "output=$WORK/run" \
    --set "${TRAIN_NET[0]}" --set "${TRAIN_NET[1]}" --set "${TRAIN_NET[2]}" --set "batch_size=$BATCH" \
    --set "fp16=$FP16" --set "num_workers=$WORKERS" --set "max_steps=$TRAIN_STEPS" --set num_epoch=1000 \
    --set "frequent=$FREQUENT" --set verbose=1000000 --set save_all_states=False > "$WORK/train.out" \
    || { tail -n 20 "$WORK/train.out"; exit 1; }
grep -o "Speed .*Global Step: [0-9]*" "$WORK/train.out" | tail -n 5
# the first log lines include start-up; the last ones are the steady state
echo "steady two-view samples/s from the .rec: $(grep -o 'Speed [0-9.]* samples' "$WORK/train.out" | tail -n 5 \
    | awk '{s += $2; n++} END {printf "%.1f (mean of the last %d log lines)", s / n, n}')"
