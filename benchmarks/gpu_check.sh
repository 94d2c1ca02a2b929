#!/usr/bin/env bash
# The one prepared GPU check (issue 35): run it from the project root on a GPU machine, through the device tool.
#
#   bash ../shared/gpu/make_site.sh            # here, once: .gpu/site.tgz, the packages the GPU machine lacks
#                                              # (EXTRA="liger-kernel==0.8.5" bash ../shared/gpu/make_site.sh for Liger)
#   device run: command "bash benchmarks/gpu_check.sh", carry [".gpu"], timeout_s 600
#
# Steps, each independent (one failing or timing out does not stop the next), under ~9 minutes in all:
#   1. unpack .gpu/site.tgz when present, PYTHONPATH = the unpacked packages + the checkout;
#   2. nvidia-smi and the Python packages' versions                               -> $OUT/env.txt
#   3. benchmarks/train_gpu_step.py (the 1.1B shape, not --tiny), ended by its own --time-limit inside an outer
#      timeout; its JSON (partial: true if it was cut short)                     -> $OUT/train_gpu_step.json
#      the log's tail                                                            -> $OUT/train_gpu_step.log
#   4. benchmarks/generation_speed.py --device cuda, when that option exists     -> $OUT/generation_speed.json/.log
#   5. each step's exit status and seconds                                       -> $OUT/gpu_check.txt
# Outside the device tool $OUT is unset: the files go to .gpu/out. On a machine without CUDA each benchmark records
# itself as skipped. Budgets in seconds: GPU_CHECK_SECONDS (all, 530), TRAIN_SECONDS (train_gpu_step, at most 330),
# GEN_SECONDS (generation_speed, 150: its own, kept aside before training starts, never what training leaves);
# TRAIN_ARGS / GEN_ARGS add arguments; PYTHON picks the interpreter (python3).
# Exit status: 0 when every step that ran exited 0; 1 when one did not (a missed goal: train_gpu_step.py exits 1
# on a GPU when a goal is missed; a failed section; a timeout), the failing steps named last in gpu_check.txt.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/.gpu/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TOTAL=${GPU_CHECK_SECONDS:-530}
TRAIN_SECONDS=${TRAIN_SECONDS:-330}
GEN_SECONDS=${GEN_SECONDS:-150}
START=$(date +%s)
FAILED=""
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SUMMARY=$OUT/gpu_check.txt
: > "$SUMMARY"

note() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $(( TOTAL - ($(date +%s) - START) )); }

step() {  # step NAME SECONDS LOG CMD...: run CMD under a timeout, its output to LOG (tail kept), status noted
  local name=$1 secs=$2 log=$3 t0 rc
  shift 3
  if [ "$secs" -lt 30 ]; then
    note "$name: skipped, ${secs}s left of the ${TOTAL}s budget"
    return 0
  fi
  t0=$(date +%s)
  timeout -k 15 "$secs" "$@" > "$log.full" 2>&1
  rc=$?
  tail -c 2000000 "$log.full" > "$log" && rm -f "$log.full"
  note "$name: exit $rc in $(( $(date +%s) - t0 ))s (limit ${secs}s)$([ $rc -eq 124 ] && echo ', timed out')"
  [ "$rc" -eq 0 ] || FAILED="$FAILED $name"
  return 0
}

# 1. packages the GPU machine lacks (../shared/gpu/make_site.sh builds them)
SITE=""
if [ -f .gpu/site.tgz ]; then
  rm -rf .gpu/site && tar xzf .gpu/site.tgz -C .gpu && SITE=$ROOT/.gpu/site
  note "site: .gpu/site.tgz unpacked ($(ls "$SITE" | wc -l) entries)"
else
  note "site: no .gpu/site.tgz (bitsandbytes, trl, datasets, pydantic... must be installed already)"
fi
export PYTHONPATH=${SITE:+$SITE:}$ROOT${PYTHONPATH:+:$PYTHONPATH}

# 2. the machine and the versions
{
  echo "== date"; date -u
  echo "== nvidia-smi"; nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  echo "== python"; "$PY" - <<'EOF' 2>&1
import importlib.metadata as md
import sys

print(sys.version.split()[0], sys.executable, "PYTHONPATH first:", sys.path[1] if len(sys.path) > 1 else "")
for p in ("torch", "transformers", "peft", "accelerate", "trl", "datasets", "bitsandbytes", "liger-kernel", "pydantic",
          "triton", "pyarrow", "numpy"):
    try:
        print(f"{p} {md.version(p)}")
    except md.PackageNotFoundError:
        print(f"{p} -")
try:
    import torch

    print("cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          torch.cuda.get_device_name() if torch.cuda.is_available() else "")
    for mod, name in (("torch.nn.attention.varlen", "varlen_attn"), ("torch.nn.attention.flex_attention",
                                                                      "flex_attention")):
        try:
            print(f"{mod}.{name}:", hasattr(__import__(mod, fromlist=[name]), name))
        except ImportError as e:
            print(f"{mod}: {e}")
except Exception as e:  # noqa: BLE001
    print("torch:", type(e).__name__, e)
EOF
} > "$OUT/env.txt" 2>&1
note "env: $OUT/env.txt"

# 3. training speed and memory against TRL (its own --time-limit ends it 60 s inside the outer timeout), in what the
#    budget holds once generation's GEN_SECONDS are set aside
room=$(( $(left) - GEN_SECONDS ))
secs=$(( TRAIN_SECONDS < room ? TRAIN_SECONDS : room ))
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of arguments
step train_gpu_step "$secs" "$OUT/train_gpu_step.log" "$PY" benchmarks/train_gpu_step.py \
  --time-limit $(( secs > 120 ? secs - 60 : secs / 2 )) --out "$OUT/train_gpu_step.json" ${TRAIN_ARGS:-}
[ -s "$OUT/train_gpu_step.json" ] || note "train_gpu_step: no JSON (see train_gpu_step.log)"

# 4. generation engines on the GPU (when generation_speed.py has --device)
if "$PY" benchmarks/generation_speed.py --help 2>/dev/null | grep -q -- '--device'; then
  # shellcheck disable=SC2086
  gen=$(( GEN_SECONDS < $(left) ? GEN_SECONDS : $(left) ))
  step generation_speed "$gen" "$OUT/generation_speed.log" "$PY" benchmarks/generation_speed.py \
    --device cuda --out "$OUT/generation_speed.json" ${GEN_ARGS:-}
else
  note "generation_speed: skipped, this checkout's benchmarks/generation_speed.py has no --device"
fi

note "total: $(( $(date +%s) - START ))s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
if [ -n "$FAILED" ]; then
  note "FAILED:$FAILED (see each step's log and JSON: goals_missed, failed)"
  exit 1
fi
note "all steps exited 0"
exit 0
