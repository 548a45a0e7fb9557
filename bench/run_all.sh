#!/usr/bin/env bash
# Run every bench scenario against the rig's llama-server (started and reset by the
# harness) with the arms that exist today, and write bench/results/<scenario>/.
# Usage: bench/run_all.sh [scenario ...]     (default: all of them)
# Extra arms: ARMS="--serve-arm repair-on" bench/run_all.sh sliding-window
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
REPS=${REPS:-2}
PASSTHROUGH="passthrough:PREFIXPIN_AFFINITY=0,PREFIXPIN_REPAIR=0,PREFIXPIN_PARKING=0,PREFIXPIN_RETRY_GRACE_S=0"
SCENARIOS=("$@")
if [ ${#SCENARIOS[@]} -eq 0 ]; then
  SCENARIOS=(extend-only reasoning-strip think-strip sliding-window prune compaction
             volatile-system tools-reorder interleaved timeout-resend)
fi
for scenario in "${SCENARIOS[@]}"; do
  echo "=== $scenario" >&2
  # shellcheck disable=SC2086 # ARMS is a list of flags on purpose
  "$PY" bench/replay.py --scenario "$scenario" --start-llama --arm direct \
    --serve-arm "$PASSTHROUGH" ${ARMS:-} --reps "$REPS"
done
