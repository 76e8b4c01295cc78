#!/usr/bin/env bash
# Seventh session: the automatic offload over sizes and budgets, in one call.
#   JOBS_A / JOBS_B: runs of bench/peers.py, ";"-separated, each "CAP_GIB|SYSTEMS|SIZES[|LABEL]" (SYSTEMS
#     "auto" = protrain_offload with --offload auto: offload without counts and no options, so the
#     backend chooses everything for the capped device (verify's default: Inductor's plan on CUDA);
#     "autoi" / "autog": the same with verify="inductor" / "graph"; LABEL: the run's own output folder
#     capCAP_LABEL, so that a job can run again after an earlier one of the same cap). Lane a runs
#     JOBS_A, lane b JOBS_B. CACHE_FROM: a machine-cache folder copied in first (an earlier call's).
#   TESTS: GPU test files run first in lane a (empty: none). MAIN=1: the README's main job.
#   EXTRA: a command run in lane a after the tests, its output in $O/a/extra.log (its files: write
#     them under $O/a/extra).
# LANES="a b" runs the lanes side by side on the 2-GPU machine (each its GPU and 16 cores; they share
# the host's memory bandwidth, so offloaded steps run slower than alone); LANES=ab runs lane a then
# lane b on the one-GPU machine. Writes $OUT/session7.tgz (logs, JSON, tables, measured rates).
set -u
export PYTHONUNBUFFERED=1
O=/tmp/session7; mkdir -p "$O/a" "$O/b"
END=$(( $(date +%s) + ${DEADLINE_S:-560} ))
source bench/device_setup.sh
# Parallel Inductor compile shortens every first step; fall back to one thread if the workers fail.
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-8}
if ! timeout 120 python3 -c '
import torch
f = torch.compile(lambda x: (x.sin() * 2).sum())
print("compile workers ok", f(torch.ones(4, device="cuda")).item())' > "$O/compile_check.log" 2>&1; then
  export TORCHINDUCTOR_COMPILE_THREADS=1
fi
echo "TORCHINDUCTOR_COMPILE_THREADS=$TORCHINDUCTOR_COMPILE_THREADS" >> "$O/machine.txt"
LANES=${LANES-"ab"}
TESTS=${TESTS-}
MAIN=${MAIN-}
EXTRA=${EXTRA-}
HOST_GIB=${HOST_GIB-120}
# measured steps after the 2 warm-up ones; 6 reaches the backend's own step and rate window (calls 3-8)
STEPS=${STEPS-6}
# STREAM: steps after those with no device sync between them (peers.py --stream-steps; 0: none)
STREAM=${STREAM-0}
JOBS_A=${JOBS_A-"24|compile|350M;24|auto|350M 760M 1.3B 4.2B"}
JOBS_B=${JOBS_B-}

lane() {  # lane NAME JOBS
  local name=$1 jobs=$2
  export PROTRAIN_CACHE_DIR=$O/$name/cache  # the measured machine rates and op times land in the tarball
  # CACHE_FROM: a cache directory of an earlier call (the rates training reached there, kept)
  [ -n "${CACHE_FROM:-}" ] && [ -d "$CACHE_FROM" ] && mkdir -p "$PROTRAIN_CACHE_DIR" && cp -r "$CACHE_FROM"/. "$PROTRAIN_CACHE_DIR"/
  left() { echo $((END - $(date +%s))); }
  if [ "$name" = a ] && [ -n "$TESTS" ]; then
    # SIGINT at the timeout: pytest still prints the failures so far.
    # shellcheck disable=SC2086
    timeout -s INT -k 30 "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -s -rfE --tb=short --durations=0 -p no:cacheprovider $TESTS > "$O/a/pytest.log" 2>&1
    echo "pytest exit $?" >> "$O/a/pytest.log"
  fi
  if [ "$name" = a ] && [ -n "$EXTRA" ]; then
    mkdir -p "$O/a/extra"; bash -c "$EXTRA" > "$O/a/extra.log" 2>&1; echo "extra exit $?" >> "$O/a/extra.log"
  fi
  if [ "$name" = a ] && [ -n "$MAIN" ]; then
    timeout 100 python3 examples/train_gpt.py --out "$O/a/main" > "$O/a/main.log" 2>&1; echo "exit $?" >> "$O/a/main.log"
  fi
  local IFS_SAVE=$IFS job cap systems sizes extra out est
  IFS=';'; read -ra list <<< "$jobs"; IFS=$IFS_SAVE
  for job in "${list[@]}"; do
    [ -z "$job" ] && continue
    cap=${job%%|*}; systems=${job#*|}; sizes=${systems#*|}; systems=${systems%%|*}
    label=""; [[ "$sizes" == *"|"* ]] && { label=_${sizes#*|}; sizes=${sizes%%|*}; }
    # a run's expected wall (the preflight skips it with less left): the automatic runs' walls on the
    # H200 so far, by the job's largest size (350M 105 s, 760M 124-131, 1.3B 202, 4.2B 217-360)
    est=120; [[ "$sizes" == *760M* ]] && est=140; [[ "$sizes" == *1.3B* ]] && est=210; [[ "$sizes" == *4.2B* ]] && est=300
    extra=(); [ "$systems" = auto ] && { systems=protrain_offload; extra=(--offload auto --default-estimate-s $est); }
    [ "$systems" = autoi ] && { systems=protrain_offload; extra=(--offload auto:inductor --default-estimate-s $est); }
    [ "$systems" = autog ] && { systems=protrain_offload; extra=(--offload auto:graph --default-estimate-s $est); }
    out="$O/$name/cap$cap$label"
    local resume=(); [ -f "$out/peers.json" ] && resume=(--resume "$out/peers.json")
    # shellcheck disable=SC2086
    python3 bench/peers.py --sizes $sizes --systems $systems "${extra[@]}" --cap-gib "$cap" --host-ram-gib "$HOST_GIB" --steps "$STEPS" \
      --stream-steps "$STREAM" --out "$out" "${resume[@]}" --deadline-s "$(left)" >> "$O/$name/peers_cap$cap.log" 2>&1
  done
}

vars="O=$O END=$END HOST_GIB='$HOST_GIB' STEPS='$STEPS' STREAM='$STREAM' TESTS='$TESTS' MAIN='$MAIN' EXTRA='$EXTRA'"
if [ "$LANES" = "ab" ]; then  # the one-GPU machine
  bash -c "$(declare -f lane); $vars lane a '$JOBS_A'; $vars lane b '$JOBS_B'"
else
  (export CUDA_VISIBLE_DEVICES=0; taskset -c 0-15 bash -c "$(declare -f lane); $vars lane a '$JOBS_A'") &
  (export CUDA_VISIBLE_DEVICES=1; taskset -c 16-31 bash -c "$(declare -f lane); $vars lane b '$JOBS_B'") &
  wait
fi
free -g | head -2 >> "$O/machine.txt"
tar czf "$OUT/session7.tgz" -C "$O" .
cat "$O/machine.txt"; tail -n 60 "$O/a/pytest.log" 2>/dev/null; cat "$O/a/extra.log" 2>/dev/null; grep -h "exit\|tok\|peak" "$O"/a/main.log 2>/dev/null | tail -n 6
for f in "$O"/*/cap*/peers.md; do echo "== $f"; tail -n 12 "$f"; done
for f in "$O"/*/*.log; do echo "== $f"; grep -hE "OOM|crash|not_run|refused|Error" "$f" | tail -n 8; done
