#!/usr/bin/env bash
# Issue 3: the whole B24 ladder (every system, 350M upward, each to its first failure), resumable
# across device calls. Needs .whl/ carried for DeepSpeed (anchors.md says how to build it).
#   call 1:  bash bench/issue3_ladder.sh
#   call 2:  copy call 1's peers.json to bench/resume_b24.json (untracked, it travels), then
#            RESUME=bench/resume_b24.json bash bench/issue3_ladder.sh
# Chain the calls within the machine's 30 s warm window to save a restart. Estimated ~22 device
# minutes in all (compile-based systems ~50 s a run; FSDP2 and DeepSpeed ~1-2 min at 2.7B-4.2B).
set -u
O=/tmp/issue3; mkdir -p "$O"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 bench/peers.py --ladder --sizes 350M 760M 1.3B 2.7B 4.2B 6.7B --plan ${PLAN:-swap=2,checkpoint=4} \
  --deadline-s "${DEADLINE_S:-540}" --out "$O" ${RESUME:+--resume "$RESUME"} > "$O/ladder.log" 2>&1
cp "$O/peers.json" "$O/peers.md" "$OUT/" 2>/dev/null
cp "$O"/*.png "$OUT/" 2>/dev/null
tail -n 60 "$O/ladder.log" | grep -v "^\s*$" | tail -n 15
tail -n 45 "$O/peers.md"
