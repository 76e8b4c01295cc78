#!/usr/bin/env bash
# Sixth session: the automatic plans on the GPU, in one call.
#   lane a: where the roofline estimate of a block goes (ROOF: a size for bench/roofline_ops.py), the GPU tests (TESTS: the automatic offload, the automatic activation plan, the predicted
#     peak), the README's main job (MAIN=1: examples/train_gpt.py, plain and --offload), then B24 at
#     the CAP_GIB cap: PEERS at PEER_SIZES (compile at 350M: the 0.98x target) and the automatic
#     offload (protrain_offload[auto]: offload without counts, no options, so the backend chooses
#     everything for the capped device) at SIZES_A.
#   lane b: the automatic offload at SIZES_B, then the hand plans of HAND (one "SIZE=SPEC" each).
# LANES="a b" runs the lanes side by side on the 2-GPU machine (each its GPU and 16 cores);
# LANES=ab runs lane a then lane b on the one-GPU machine. Every variable can be overridden; empty:
# skip. Writes $OUT/session6.tgz (logs, JSON, tables, the measured machine rates).
set -u
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
O=/tmp/session6; mkdir -p "$O/a" "$O/b"
END=$(( $(date +%s) + ${DEADLINE_S:-560} ))
source bench/device_setup.sh
LANES=${LANES-"a b"}
TESTS=${TESTS-"tests/test_gpu_auto_offload.py tests/test_gpu_auto_plan.py tests/test_gpu_memory.py"}
MAIN=${MAIN-1}
ROOF=${ROOF-350M}
CAP_GIB=${CAP_GIB-24}
PEERS=${PEERS-"compile"}
PEER_SIZES=${PEER_SIZES-"350M"}
SIZES_A=${SIZES_A-"350M 760M"}
SIZES_B=${SIZES_B-"1.3B 4.2B"}
HAND=${HAND-}
HOST_GIB=${HOST_GIB-120}

lane_a() {
  export PROTRAIN_CACHE_DIR=$O/a/cache  # the measured machine rates land in the tarball
  left() { echo $((END - $(date +%s))); }
  if [ -n "$ROOF" ]; then
    timeout 90 python3 bench/roofline_ops.py --size "$ROOF" > "$O/a/roofline.log" 2>&1
  fi
  if [ -n "$TESTS" ]; then
    # shellcheck disable=SC2086
    timeout 240 python3 -m pytest -q -s -p no:cacheprovider $TESTS > "$O/a/pytest.log" 2>&1
    echo "pytest exit $?" >> "$O/a/pytest.log"
  fi
  if [ -n "$MAIN" ]; then
    timeout 100 python3 examples/train_gpt.py --out "$O/a/main" > "$O/a/main.log" 2>&1; echo "exit $?" >> "$O/a/main.log"
    timeout 100 python3 examples/train_gpt.py --offload --budget 9GiB --out "$O/a/main_offload" \
      > "$O/a/main_offload.log" 2>&1; echo "exit $?" >> "$O/a/main_offload.log"
  fi
  local common=(--cap-gib "$CAP_GIB" --host-ram-gib "$HOST_GIB" --out "$O/a/b24")
  if [ -n "$PEERS" ]; then
    # shellcheck disable=SC2086
    python3 bench/peers.py --sizes $PEER_SIZES --systems $PEERS "${common[@]}" --deadline-s "$(left)" > "$O/a/peers.log" 2>&1
  fi
  if [ -n "$SIZES_A" ]; then
    local resume=(); [ -f "$O/a/b24/peers.json" ] && resume=(--resume "$O/a/b24/peers.json")
    # shellcheck disable=SC2086
    python3 bench/peers.py --sizes $SIZES_A --systems protrain_offload --offload auto "${common[@]}" "${resume[@]}" \
      --deadline-s "$(left)" > "$O/a/auto.log" 2>&1
  fi
}

lane_b() {
  export PROTRAIN_CACHE_DIR=$O/b/cache
  left() { echo $((END - $(date +%s))); }
  local common=(--cap-gib "$CAP_GIB" --host-ram-gib "$HOST_GIB" --out "$O/b/b24")
  if [ -n "$SIZES_B" ]; then
    # shellcheck disable=SC2086
    python3 bench/peers.py --sizes $SIZES_B --systems protrain_offload --offload auto "${common[@]}" \
      --default-estimate-s 150 --deadline-s "$(left)" > "$O/b/auto.log" 2>&1
  fi
  for spec in $HAND; do
    local resume=(); [ -f "$O/b/b24/peers.json" ] && resume=(--resume "$O/b/b24/peers.json")
    python3 bench/peers.py --sizes "${spec%%=*}" --systems protrain_offload --offload "${spec#*=}" \
      "${common[@]}" "${resume[@]}" --deadline-s "$(left)" >> "$O/b/hand.log" 2>&1
  done
}

vars="O=$O END=$END HOST_GIB='$HOST_GIB' TESTS='$TESTS' MAIN='$MAIN' ROOF='$ROOF' CAP_GIB='$CAP_GIB' PEERS='$PEERS' PEER_SIZES='$PEER_SIZES' SIZES_A='$SIZES_A' SIZES_B='$SIZES_B' HAND='$HAND'"
if [ "$LANES" = "ab" ]; then  # the one-GPU machine
  bash -c "$(declare -f lane_a lane_b); $vars lane_a; $vars lane_b"
else
  (export CUDA_VISIBLE_DEVICES=0; taskset -c 0-15 bash -c "$(declare -f lane_a); $vars lane_a") &
  (export CUDA_VISIBLE_DEVICES=1; taskset -c 16-31 bash -c "$(declare -f lane_b); $vars lane_b") &
  wait
fi
free -g | head -2 >> "$O/machine.txt"
tar czf "$OUT/session6.tgz" -C "$O" .
cat "$O/machine.txt"; grep -v "Warn\|warn" "$O/a/roofline.log" 2>/dev/null | tail -n 40; tail -n 30 "$O/a/pytest.log" 2>/dev/null
grep -h "exit\|tok\|peak\|chunks:\|Error" "$O"/a/main*.log 2>/dev/null | tail -n 12
for f in "$O"/a/b24/peers.md "$O"/b/b24/peers.md; do echo "== $f"; tail -n 12 "$f" 2>/dev/null; done
for f in "$O"/*/*.log; do echo "== $f"; grep -hE "tok/s|OOM|crash|not_run|refused|Error" "$f" | tail -n 8; done
