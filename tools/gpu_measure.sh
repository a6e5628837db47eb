#!/usr/bin/env bash
# The GPU measurements of docs/performance-log.md ("On one GPU"), as run on the lent H100/H200:
#   bash tools/gpu_measure.sh OUT_DIR [part...]
#   parts: gen tests bench profile pricing synthetic jpeg jpegcpu default (default: tests bench synthetic jpeg)
# labkit must be importable (pip install -e ., or PYTHONPATH); JPEGs go to $JPEGS (/tmp/jp).
# DEADLINE (epoch seconds), if set, bounds every part: a part still running then is stopped,
# so the parts after it and the files already written are not lost with a lease's end.
# profile: the bench with torch.profiler traces, then tools/hta_compare.py on them (needs
# holistictraceanalysis); pricing: what each instrument costs on a GPU step of a few ms (the
# embedded default's model and data) and on resnet18, one rank on nccl; default: `labkit experiment` with no flags (the machine's default plan).
# COMMON replaces the model flags (a dry run on a CPU: COMMON="--model resnet10_small --batch-size 32").
# Packages installed with pip --target DIR (wheels carried to a machine with no network) need
# JUPYTER_PATH=DIR/share/jupyter, or nbconvert finds no 'lab' template and the reports fail.
# How long each part took on one H200: docs/performance-log.md, "On one GPU (2026-11-26)".
set -uo pipefail
OUT=${1:?output folder}; shift
PARTS=${*:-tests bench synthetic jpeg}
JPEGS=${JPEGS:-/tmp/jp}
L="python3 -m labkit"
R=$OUT/runs
mkdir -p "$R"
common=${COMMON:-"--model resnet50 --batch-size 256 --amp bf16 --channels-last"}
nvidia-smi -L | tee "$OUT/gpu.txt"; python3 -c "import torch, torchvision; print(torch.__version__, torchvision.__version__)" | tee -a "$OUT/gpu.txt"
left() { [ -n "${DEADLINE:-}" ] && echo $(( DEADLINE - $(date +%s) )) || echo 100000; }
for p in $PARTS; do
  t0=$(date +%s)
  if [ "$(left)" -le 5 ]; then echo "== $p: not started, DEADLINE reached" | tee -a "$OUT/summary.txt"; continue; fi
  case $p in
    gen) [ -d "$JPEGS/train" ] || python3 tools/make_jpeg_folder.py "$JPEGS" --train 20000 --val 1000 --classes 100 ;;
    tests) timeout "$(left)" python3 -m pytest -v -p no:cacheprovider -rs -n "${TEST_WORKERS:-1}" --dist loadgroup \
             tests/test_gpu_ranks.py tests/test_gpu_data.py tests/test_gpu_path.py tests/test_machine_plan.py ;;
    profile) timeout "$(left)" $L bench --dataset synthetic $common --nproc 1 --variants ddp,allreduce \
               --profile-steps 5 --no-report --runs-dir "$R" --tag profile \
             && { python3 tools/hta_compare.py "$(ls -d "$R"/*_profile | tail -1)" --json "$OUT/hta.json" \
                    >"$OUT/hta.txt" 2>&1 & } ;;  # on the CPU, beside the next parts
    pricing) timeout "$(left)" $L bench --dataset digits --model resnet10_small --batch-size 32 --nproc 1 \
               --variants ddp,allreduce --trials 16 --steps 20 --no-report --runs-dir "$R" --tag pricing-small \
             && timeout "$(left)" $L bench --dataset synthetic --model resnet18 --batch-size 64 --nproc 1 \
               --variants ddp --trials 16 --steps 20 --no-report --runs-dir "$R" --tag pricing-resnet18 ;;
    default) timeout "$(left)" $L experiment --runs-dir "$R" --tag default ;;
    bench) timeout "$(left)" $L bench --dataset synthetic $common --nproc 1 --variants ddp,allreduce --runs-dir "$R" --tag bench ;;
    synthetic) timeout "$(left)" $L experiment --methods ddp,allreduce --nproc 1 --dataset synthetic $common \
                 --synthetic-samples 15360 --epochs 2 --runs-dir "$R" --tag synthetic ;;
    jpeg) timeout "$(left)" $L experiment --methods ddp,allreduce --nproc 1 --data-dir "$JPEGS" $common --epochs 2 \
            --max-val-steps 2 --runs-dir "$R" --tag jpeg-gpu ;;
    jpegcpu) timeout "$(left)" $L experiment --methods ddp --nproc 1 --data-dir "$JPEGS" $common --epochs 1 \
               --max-steps-per-epoch 40 --max-val-steps 2 --decode cpu --runs-dir "$R" --tag jpeg-cpu ;;
  esac 2>&1 | tee "$OUT/$p.log"
  echo "== $p: exit ${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
done
# the HTA comparison, if it still runs (bounded by DEADLINE too)
while pgrep -f tools/hta_compare.py >/dev/null && [ "$(left)" -gt 0 ]; do sleep 2; done
