#!/usr/bin/env bash
# Run every bench scenario against the rig's llama-server (started and reset by the
# harness) with the arms that exist today, and write bench/results/<scenario>/.
# Usage: bench/run_all.sh [scenario ...]     (default: all of them)
# Extra arms: ARMS="--serve-arm name:ENV=VALUE" bench/run_all.sh sliding-window
#
# Arms: direct (llama-server itself), passthrough (prefixpin, every feature off),
# prefixpin (defaults: affinity, repair, parking into the engine's --slot-save-path);
# sliding-window adds repair-off (affinity and parking on, PREFIXPIN_REPAIR=0: the issue's
# off/on ratio) and interleaved adds affinity (affinity alone: no repair, no parking).
# replica-parking is its own bench (bench/replica_parking.py: two replicas, two one-slot
# llama-servers, redis-server; arms alone, before, prefixpin, prefixpin-shared).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
REPS=${REPS:-2}
PASSTHROUGH="passthrough:PREFIXPIN_AFFINITY=0,PREFIXPIN_REPAIR=0,PREFIXPIN_PARKING=0,PREFIXPIN_RETRY_GRACE_S=0"
PREFIXPIN="prefixpin:PREFIXPIN_PARK_DIR={slots}"
REPAIR_OFF="repair-off:PREFIXPIN_REPAIR=0,PREFIXPIN_PARK_DIR={slots}"
AFFINITY="affinity:PREFIXPIN_REPAIR=0,PREFIXPIN_PARKING=0"
SCENARIOS=("$@")
if [ ${#SCENARIOS[@]} -eq 0 ]; then
  SCENARIOS=(extend-only reasoning-strip think-strip sliding-window prune compaction
             volatile-system tools-reorder interleaved timeout-resend replica-parking)
fi
for scenario in "${SCENARIOS[@]}"; do
  echo "=== $scenario" >&2
  extra=()
  case "$scenario" in
    replica-parking) "$PY" bench/replica_parking.py; continue ;;
    sliding-window) extra=(--serve-arm "$REPAIR_OFF") ;;
    interleaved) extra=(--serve-arm "$AFFINITY") ;;
  esac
  # shellcheck disable=SC2086 # ARMS is a list of flags on purpose
  "$PY" bench/replay.py --scenario "$scenario" --start-llama --arm direct \
    --serve-arm "$PASSTHROUGH" "${extra[@]}" --serve-arm "$PREFIXPIN" ${ARMS:-} --reps "$REPS"
done
