#!/usr/bin/env bash
# Second issue-4 device call: where swap time goes (profile), and 760M at the 24 GiB cap with no plan.
set -u
O=/tmp/issue4b; rm -rf "$O"; mkdir -p "$O"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$O/pip.log" 2>&1
timeout 300 python3 bench/swap_profile.py --size 760M --plans swap=0,checkpoint=0 swap=2,checkpoint=0 \
  --machine '{"d2h_bytes": 15e9, "h2d_bytes": 15e9}' --out "$O/profile" > "$O/profile.log" 2>&1
python3 bench/peers.py --sizes 760M --systems protrain compile --cap-gib 24 --out "$O/capped" --deadline-s 180 > "$O/capped.log" 2>&1
cp "$O/profile/swap_profile.json" "$OUT/" 2>/dev/null
for f in "$O"/profile/trace_*.json; do gzip -c "$f" > "$OUT/$(basename "$f").gz"; done
rm -rf "$O"/profile/trace_*.json
tar czf "$OUT/issue4b.tgz" -C "$O" .
cat "$O/profile.log" | cut -c1-600; tail -n 5 "$O/capped/peers.md"
