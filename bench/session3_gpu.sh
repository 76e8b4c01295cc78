#!/usr/bin/env bash
# Issues 3, 4 and 5 on the 2-GPU machine (nvidia-h200-x2), two lanes at once, each on its own GPU and
# its own 16 cores (the one-GPU machine's count), each resumable across device calls:
#   lane a (GPU 0, cores 0-15): GPU tests of chunks and swap (first call only), then the ladder of the
#     systems that keep everything on the GPU (protrain, a hand plan, eager, eager + AC, compile,
#     compile + activation_memory_budget 0 / 0.5), 350M upward, each to its first failure.
#   lane b (GPU 1, cores 16-31): B24 4.2B with protrain_offload (two hand settings), FSDP2 and DeepSpeed
#     side by side, then the FSDP2 / DeepSpeed ladder from 350M, then protrain_offload at 6.7B.
#     Host RAM is capped at 120 GiB (--host-ram-gib), what the one-GPU machine has free of its 125.
#   call 1:  bash bench/session3_gpu.sh
#   call 2:  copy call 1's a/peers.json and b/peers.json to bench/resume_a.json / bench/resume_b.json
#            (untracked: they travel), then RESUME=1 bash bench/session3_gpu.sh
# Needs .whl/ carried for DeepSpeed (anchors.md). Writes $OUT/session3.tgz (logs, JSON, tables, plots).
set -u
export PYTHONUNBUFFERED=1
O=/tmp/session3; mkdir -p "$O/a" "$O/b"
END=$(( $(date +%s) + ${DEADLINE_S:-545} ))  # every run is planned to end by then
source bench/device_setup.sh
OFFLOAD=${OFFLOAD:-"persist=0,buffer=3,checkpoint=all persist=2,buffer=3,checkpoint=all"}

lane_a() {
  if [ -z "${RESUME:-}" ]; then
    timeout 240 python3 -m pytest -q -x tests/test_gpu_offload.py tests/test_gpu_swap.py > "$O/a/pytest.log" 2>&1
    echo "pytest exit $?" >> "$O/a/pytest.log"
  fi
  python3 bench/peers.py --ladder --sizes 350M 760M 1.3B 2.7B \
    --systems protrain protrain_plan eager eager_ac compile compile_amb0 compile_amb05 --plan swap=2,checkpoint=4 \
    --deadline-s $((END - $(date +%s))) --out "$O/a" ${RESUME:+--resume bench/resume_a.json} > "$O/a/ladder.log" 2>&1
}

lane_b() {
  local common=(--host-ram-gib 120 --out "$O/b")
  local resume=()
  [ -n "${RESUME:-}" ] && resume=(--resume bench/resume_b.json)
  # shellcheck disable=SC2086
  python3 bench/peers.py --sizes 4.2B --systems protrain_offload fsdp2 deepspeed --offload $OFFLOAD \
    "${common[@]}" "${resume[@]}" --deadline-s $((END - $(date +%s))) > "$O/b/offload42.log" 2>&1
  python3 bench/peers.py --ladder --sizes 350M 760M 1.3B 2.7B 4.2B 6.7B --systems fsdp2 deepspeed \
    "${common[@]}" --resume "$O/b/peers.json" --deadline-s $((END - $(date +%s))) > "$O/b/ladder.log" 2>&1
  python3 bench/peers.py --sizes 6.7B --systems protrain_offload --offload "persist=0,buffer=3,checkpoint=all" \
    "${common[@]}" --resume "$O/b/peers.json" --deadline-s $((END - $(date +%s))) > "$O/b/offload67.log" 2>&1
}

(export CUDA_VISIBLE_DEVICES=0; taskset -c 0-15 bash -c "$(declare -f lane_a); O=$O END=$END RESUME=${RESUME:-} lane_a") &
(export CUDA_VISIBLE_DEVICES=1; taskset -c 16-31 bash -c "$(declare -f lane_b); O=$O END=$END RESUME=${RESUME:-} OFFLOAD='$OFFLOAD' lane_b") &
wait
tar czf "$OUT/session3.tgz" -C "$O" .
cat "$O/machine.txt"; tail -n 4 "$O/a/pytest.log" 2>/dev/null
for f in "$O"/a/ladder.log "$O"/b/*.log; do echo "== $f"; grep -E "tok/s|OOM|crash|not_run|host RAM|refused|skipped|this call" "$f" | grep -v "^|" | tail -n 20; done
