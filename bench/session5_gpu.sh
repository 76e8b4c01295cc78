#!/usr/bin/env bash
# Fifth session, one call: two lanes on the 2-GPU machine (nvidia-h200-x2), or lane b alone on the
# one-GPU machine (LANES=b). Each lane has its own GPU and its own 16 cores (the one-GPU machine's
# count); offloading runs cap the host RAM check at HOST_GIB (120: what the one-GPU machine has free).
#   lane a (GPU 0, cores 0-15): the GPU tests (chunks incl. lean ones, swap, pinned memory, predicted
#     peak), then issue 4 again: the swap series of bench/swap_profile.py (760M, swap 0..3, the hidden
#     fraction of the copies), 760M hand plans at the 20 GiB cap next to compile + activation memory
#     budget, and the bf16 loss of a mixed plan over 50 steps against eager.
#   lane b (GPU 1, cores 16-31): OFFLOAD10 (B24 10B through protrain_offload, lean chunks), then
#     OFFLOAD42 (4.2B) and the DeepSpeed ladder 350M..2.7B with its initialisation fix (PEER_LADDER).
#   LANES=b bash bench/session5_gpu.sh    (one-GPU machine: lane b on GPU 0)
# Every variable above can be overridden; empty: skip. Needs .whl/ carried for DeepSpeed.
# Writes $OUT/session5.tgz (logs, JSON, tables).
set -u
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
O=/tmp/session5; mkdir -p "$O/a" "$O/b"
END=$(( $(date +%s) + ${DEADLINE_S:-550} ))  # every run is planned to end by then
source bench/device_setup.sh
LANES=${LANES-"a b"}
HOST_GIB=${HOST_GIB-120}
TESTS=${TESTS-"tests/test_gpu_offload.py tests/test_gpu_swap.py tests/test_pinned.py tests/test_gpu_memory.py"}
SWAP_SERIES=${SWAP_SERIES-"swap=0,checkpoint=0 swap=1,checkpoint=0 swap=2,checkpoint=0 swap=3,checkpoint=0"}
PLANS20=${PLANS20-"swap=2,checkpoint=4 swap=1,checkpoint=5 checkpoint=6"}
LOSS_PLAN=${LOSS_PLAN-"swap=2,checkpoint=4"}
OFFLOAD10=${OFFLOAD10-"persist=2,buffer=3,gpu_optim=16,checkpoint=all"}
OFFLOAD42=${OFFLOAD42-}
PEER_LADDER=${PEER_LADDER-"deepspeed"}
LADDER_SIZES=${LADDER_SIZES-"350M 760M 1.3B 2.7B"}

lane_a() {
  if [ -n "$TESTS" ]; then
    # shellcheck disable=SC2086
    timeout 300 python3 -m pytest -q -p no:cacheprovider $TESTS > "$O/a/pytest.log" 2>&1
    echo "pytest exit $?" >> "$O/a/pytest.log"
  fi
  if [ -n "$SWAP_SERIES" ]; then
    # shellcheck disable=SC2086
    timeout 200 python3 bench/swap_profile.py --size 760M --plans $SWAP_SERIES --out "$O/a/profile" > "$O/a/profile.log" 2>&1
    rm -f "$O"/a/profile/trace_*.json
  fi
  if [ -n "$PLANS20" ]; then
    # shellcheck disable=SC2086
    python3 bench/peers.py --sizes 760M --systems compile_amb05 compile_amb0 protrain_plan --plan $PLANS20 \
      --cap-gib 20 --out "$O/a/cap20" --deadline-s $((END - $(date +%s) - 60)) > "$O/a/cap20.log" 2>&1
  fi
  if [ -n "$LOSS_PLAN" ]; then
    timeout $((END - $(date +%s) - 5)) python3 bench/swap_check.py loss --size 125M --plan "$LOSS_PLAN" --steps 50 \
      --out "$O/a/loss.json" > "$O/a/loss.log" 2>&1
  fi
}

lane_b() {
  local common=(--host-ram-gib "$HOST_GIB" --out "$O/b")
  local resume=()
  if [ -n "$OFFLOAD10" ]; then
    # shellcheck disable=SC2086
    python3 bench/peers.py --sizes 10B --systems protrain_offload --offload $OFFLOAD10 \
      "${common[@]}" --default-estimate-s 240 --deadline-s $((END - $(date +%s))) > "$O/b/offload10.log" 2>&1
  fi
  if [ -n "$OFFLOAD42" ]; then
    [ -f "$O/b/peers.json" ] && resume=(--resume "$O/b/peers.json")
    # shellcheck disable=SC2086
    python3 bench/peers.py --sizes 4.2B --systems protrain_offload --offload $OFFLOAD42 \
      "${common[@]}" "${resume[@]}" --deadline-s $((END - $(date +%s))) > "$O/b/offload42.log" 2>&1
  fi
  if [ -n "$PEER_LADDER" ]; then
    resume=()
    [ -f "$O/b/peers.json" ] && resume=(--resume "$O/b/peers.json")
    # shellcheck disable=SC2086
    python3 bench/peers.py --ladder --sizes $LADDER_SIZES --systems $PEER_LADDER \
      "${common[@]}" "${resume[@]}" --deadline-s $((END - $(date +%s))) > "$O/b/ladder.log" 2>&1
  fi
}

vars="O=$O END=$END HOST_GIB='$HOST_GIB' TESTS='$TESTS' SWAP_SERIES='$SWAP_SERIES' PLANS20='$PLANS20' LOSS_PLAN='$LOSS_PLAN' OFFLOAD10='$OFFLOAD10' OFFLOAD42='$OFFLOAD42' PEER_LADDER='$PEER_LADDER' LADDER_SIZES='$LADDER_SIZES'"
if [ "$LANES" = "b" ]; then  # the one-GPU machine
  bash -c "$(declare -f lane_b); $vars lane_b"
else
  (export CUDA_VISIBLE_DEVICES=0; taskset -c 0-15 bash -c "$(declare -f lane_a); $vars lane_a") &
  (export CUDA_VISIBLE_DEVICES=1; taskset -c 16-31 bash -c "$(declare -f lane_b); $vars lane_b") &
  wait
fi
free -g | head -2 >> "$O/machine.txt"
tar czf "$OUT/session5.tgz" -C "$O" .
cat "$O/machine.txt"; tail -n 15 "$O/a/pytest.log" 2>/dev/null
cut -c1-300 "$O/a/profile.log" 2>/dev/null | grep -i "plan\|hidden" | tail -n 8
tail -n 8 "$O/a/cap20/peers.md" 2>/dev/null; grep -h "max_rel\|within" "$O/a/loss.json" 2>/dev/null | head -3
for f in "$O"/b/*.log; do echo "== $f"; grep -E "tok/s|OOM|crash|not_run|host RAM|refused|skipped|this call|^\| " "$f" | tail -n 16; done
