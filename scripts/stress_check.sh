#!/usr/bin/env bash
# The tests that bound a count or a duration, and the multi-process ones, RUNS times in a row beside
# `stress-ng --cpu 2` (Debian's package): a test that times the host instead of the behaviour fails here
# (docs/testing.md, "The same outcome on every host and under load"). Prints one JSON line per run.
#   scripts/stress_check.sh [RUNS] [pytest paths...]
set -uo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
shift || true
PATHS=("$@")
if [ ${#PATHS[@]} -eq 0 ]; then
  PATHS=(
    tests/campaign_orchestrator/generation/scaleout/
    tests/training/test_selection_train.py
    tests/training/test_distributed.py
    tests/training/test_diagnostics.py
    tests/resources/test_k8s_launcher.py
    tests/resources/test_kuberay_launcher.py
    tests/e2e/test_crash_recovery.py
    tests/campaign_orchestrator/costs/test_scaleout_plan.py
  )
fi
command -v stress-ng >/dev/null || { echo "stress-ng is missing: apt-get install stress-ng" >&2; exit 2; }
stress-ng --cpu 2 --quiet &
STRESS=$!
trap 'kill $STRESS 2>/dev/null' EXIT
failed=0
for i in $(seq 1 "$RUNS"); do
  t0=$(date +%s)
  .venv/bin/python -m pytest "${PATHS[@]}" -m "not heavy and not vllm" -q -p no:cacheprovider >"/tmp/stress_run_$i.log" 2>&1
  rc=$?
  summary=$(grep -E "passed|failed" "/tmp/stress_run_$i.log" | tail -1)
  echo "{\"run\": $i, \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 )), \"summary\": \"${summary//\"/}\"}"
  [ $rc -eq 0 ] || failed=1
done
exit $failed
