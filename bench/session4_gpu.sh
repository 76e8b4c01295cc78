#!/usr/bin/env bash
# Fourth session, on the 2-GPU machine (nvidia-h200-x2): two lanes, each on its own GPU and its own
# 16 cores (the one-GPU machine's count), host RAM capped at 120 GiB per run (--host-ram-gib, what
# the one-GPU machine has free of its 125).
#   lane a (GPU 0, cores 0-15): the GPU tests of chunks (device-stepped chunks included) and swap,
#     then the peers at B24 4.2B: FSDP2 and DeepSpeed ZeRO-3 offload.
#   lane b (GPU 1, cores 16-31): B24 4.2B through protrain_offload after the gradient-freeing fix, with
#     and without chunks stepped on the GPU (gpu_optim), then 6.7B (OOMed on the GPU before the fix).
#   bash bench/session4_gpu.sh   (TESTS, PEERS, OFFLOAD42A (lane a, after the peers), OFFLOAD42 and
#                                 OFFLOAD67 (lane b) override what runs; empty: skip; EXTRA_A: the
#                                 arguments of one more bench/peers.py run in lane a)
# Needs .whl/ carried for DeepSpeed (anchors.md). Writes $OUT/session4.tgz (logs, JSON, tables, plots).
set -u
export PYTHONUNBUFFERED=1
O=/tmp/session4; mkdir -p "$O/a" "$O/b"
END=$(( $(date +%s) + ${DEADLINE_S:-550} ))  # every run is planned to end by then
source bench/device_setup.sh
OFFLOAD42=${OFFLOAD42-"persist=0,buffer=3,checkpoint=all persist=0,buffer=3,gpu_optim=4,checkpoint=all persist=0,buffer=3,gpu_optim=8,checkpoint=all persist=2,buffer=3,gpu_optim=4,checkpoint=all"}
OFFLOAD67=${OFFLOAD67-"persist=0,buffer=3,gpu_optim=4,checkpoint=all"}
PEERS=${PEERS-"fsdp2 deepspeed"}
TESTS=${TESTS-"tests/test_gpu_offload.py tests/test_gpu_swap.py"}
OFFLOAD42A=${OFFLOAD42A-}
EXTRA_A=${EXTRA_A-}

lane_a() {
  if [ -n "$TESTS" ]; then
    # shellcheck disable=SC2086
    timeout 240 python3 -m pytest -q $TESTS > "$O/a/pytest.log" 2>&1
    echo "pytest exit $?" >> "$O/a/pytest.log"
  fi
  if [ -n "$PEERS" ]; then
    # shellcheck disable=SC2086
    python3 bench/peers.py --sizes 4.2B --systems $PEERS --host-ram-gib 120 --out "$O/a" \
      --deadline-s $((END - $(date +%s))) > "$O/a/peers42.log" 2>&1
  fi
  if [ -n "$EXTRA_A" ]; then  # any other bench/peers.py run (its own arguments), e.g. an uncapped reference
    mkdir -p "$O/a/extra"
    # shellcheck disable=SC2086
    python3 bench/peers.py $EXTRA_A --out "$O/a/extra" --deadline-s $((END - $(date +%s))) > "$O/a/extra42.log" 2>&1
  fi
  if [ -n "$OFFLOAD42A" ]; then  # more protrain_offload settings at 4.2B, after the peers
    local resume=()
    [ -f "$O/a/peers.json" ] && resume=(--resume "$O/a/peers.json")
    # shellcheck disable=SC2086
    python3 bench/peers.py --sizes 4.2B --systems protrain_offload --offload $OFFLOAD42A --host-ram-gib 120 \
      --out "$O/a" "${resume[@]}" --deadline-s $((END - $(date +%s))) > "$O/a/offload42.log" 2>&1
  fi
}

lane_b() {
  local common=(--host-ram-gib 120 --out "$O/b")
  if [ -n "$OFFLOAD42" ]; then
    # shellcheck disable=SC2086
    python3 bench/peers.py --sizes 4.2B --systems protrain_offload --offload $OFFLOAD42 \
      "${common[@]}" --deadline-s $((END - $(date +%s))) > "$O/b/offload42.log" 2>&1
  fi
  if [ -n "$OFFLOAD67" ]; then
    local resume=()
    [ -f "$O/b/peers.json" ] && resume=(--resume "$O/b/peers.json")
    # shellcheck disable=SC2086
    python3 bench/peers.py --sizes 6.7B --systems protrain_offload --offload $OFFLOAD67 \
      "${common[@]}" "${resume[@]}" --deadline-s $((END - $(date +%s))) > "$O/b/offload67.log" 2>&1
  fi
}

(export CUDA_VISIBLE_DEVICES=0; taskset -c 0-15 bash -c "$(declare -f lane_a); O=$O END=$END TESTS='$TESTS' PEERS='$PEERS' OFFLOAD42A='$OFFLOAD42A' EXTRA_A='$EXTRA_A' lane_a") &
(export CUDA_VISIBLE_DEVICES=1; taskset -c 16-31 bash -c "$(declare -f lane_b); O=$O END=$END OFFLOAD42='$OFFLOAD42' OFFLOAD67='$OFFLOAD67' lane_b") &
wait
tar czf "$OUT/session4.tgz" -C "$O" .
cat "$O/machine.txt"; tail -n 15 "$O/a/pytest.log" 2>/dev/null
for f in "$O"/a/*42.log "$O"/b/*.log; do echo "== $f"; grep -E "tok/s|OOM|crash|not_run|host RAM|refused|skipped|this call|^\| 4|^\| 6" "$f" | tail -n 24; done
