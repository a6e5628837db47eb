#!/usr/bin/env bash
# The GPU measurements of docs/performance.md ("On one GPU"), as run on the lent H100:
#   bash tools/gpu_measure.sh OUT_DIR [part...]   parts: tests bench synthetic jpeg (default: all)
# labkit must be importable (pip install -e ., or PYTHONPATH); JPEGs go to $JPEGS (/tmp/jp).
set -uo pipefail
OUT=${1:?output folder}; shift
PARTS=${*:-tests bench synthetic jpeg}
JPEGS=${JPEGS:-/tmp/jp}
L="python3 -m labkit"
R=$OUT/runs
mkdir -p "$R"
common="--model resnet50 --batch-size 256 --amp bf16 --channels-last"
nvidia-smi -L | tee "$OUT/gpu.txt"; python3 -c "import torch, torchvision; print(torch.__version__, torchvision.__version__)" | tee -a "$OUT/gpu.txt"
for p in $PARTS; do
  t0=$(date +%s)
  case $p in
    gen) [ -d "$JPEGS/train" ] || python3 tools/make_jpeg_folder.py "$JPEGS" --train 20000 --val 1000 --classes 100 ;;
    tests) python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_ranks.py tests/test_gpu_data.py tests/test_gpu_path.py ;;
    bench) $L bench --dataset synthetic $common --nproc 1 --variants ddp,allreduce --runs-dir "$R" --tag bench ;;
    synthetic) $L experiment --methods ddp,allreduce --nproc 1 --dataset synthetic $common \
                 --synthetic-samples 15360 --epochs 2 --runs-dir "$R" --tag synthetic ;;
    jpeg) $L experiment --methods ddp,allreduce --nproc 1 --data-dir "$JPEGS" $common --epochs 2 \
            --max-val-steps 2 --runs-dir "$R" --tag jpeg-gpu ;;
    jpegcpu) $L experiment --methods ddp --nproc 1 --data-dir "$JPEGS" $common --epochs 1 \
               --max-steps-per-epoch 40 --max-val-steps 2 --decode cpu --runs-dir "$R" --tag jpeg-cpu ;;
  esac 2>&1 | tee "$OUT/$p.log"
  echo "== $p: exit ${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
done
