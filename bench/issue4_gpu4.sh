#!/usr/bin/env bash
# Fourth issue-4 device call: the swap series and the 20 GiB hand plans again after the profile-driven fixes.
# (20 GiB) where the empty plan no longer fits 760M.
set -u
O=/tmp/issue4d; rm -rf "$O"; mkdir -p "$O"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$O/pip.log" 2>&1
timeout 200 python3 bench/swap_profile.py --size 760M --plans swap=0,checkpoint=0 swap=2,checkpoint=0 swap=3,checkpoint=0 \
  --out "$O/profile" > "$O/profile.log" 2>&1
rm -f "$O"/profile/trace_*.json
python3 bench/peers.py --sizes 760M --systems compile_amb05 protrain_plan \
  --plan swap=2,checkpoint=4 checkpoint=4 swap=2,checkpoint=3 --cap-gib 20 --out "$O/cap20" --deadline-s 240 > "$O/cap20.log" 2>&1
cp "$O/profile/swap_profile.json" "$OUT/" 2>/dev/null; cp "$O/cap20/peers.json" "$OUT/cap20.json" 2>/dev/null
tar czf "$OUT/issue4d.tgz" -C "$O" .
cut -c1-400 "$O/profile.log" | grep plan; tail -n 7 "$O/cap20/peers.md"
