#!/usr/bin/env bash
# Issue 5 after the sliced CPU optimizer, on the one-GPU machine (nvidia-h200: the protocol's 16 cores
# and 125 GiB): GPU tests of chunks, CPU optimizer throughput per slice size, then B24 4.2B with
# protrain_offload and DeepSpeed ZeRO-3 offload side by side. Needs .whl/ carried (anchors.md).
#   bash bench/session3_gpu2.sh      (DEADLINE_S bounds the peers runs; default 330 s from the start)
set -u
export PYTHONUNBUFFERED=1
O=/tmp/session3b; mkdir -p "$O"
END=$(( $(date +%s) + ${DEADLINE_S:-330} ))
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
{ nvidia-smi -L; nproc; free -g | head -2; } > "$O/machine.txt" 2>&1
timeout 120 python3 -m pytest -q tests/test_gpu_offload.py > "$O/pytest.log" 2>&1; echo "pytest exit $?" >> "$O/pytest.log"
python3 bench/cpu_adam_speed.py --params 200e6 --slices 1099511627776 4194304 1048576 --out "$O" > "$O/cpu_adam.log" 2>&1
python3 bench/peers.py --sizes 4.2B --systems protrain_offload deepspeed --offload "${OFFLOAD:-persist=0,buffer=3,checkpoint=all}" \
  --deadline-s $((END - $(date +%s))) --out "$O" > "$O/peers.log" 2>&1
tar czf "$OUT/session3b.tgz" -C "$O" .
cat "$O/machine.txt"; tail -n 3 "$O/pytest.log"; cat "$O/cpu_adam.log"
grep -E "tok/s|OOM|crash|not_run|refused" "$O/peers.log" | grep -v "^|"; sed -n '/^Overlap/,$p' "$O/peers.md"
