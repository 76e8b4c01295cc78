#!/usr/bin/env bash
# Activation-swap checks on the GPU machine in one call (issue 4); everything lands in $OUT/issue4.tgz.
#   bash bench/issue4_gpu.sh            (from the repository root, with $OUT set)
# Order: most important first, each step bounded, so a slow step cannot starve the tarball.
set -u
O=/tmp/issue4; rm -rf "$O"; mkdir -p "$O"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$O/pip.log" 2>&1
left() { echo $(( ${BUDGET_S:-560} - ($(date +%s) - T0) )); }
python3 bench/swap_check.py pcie --out "$O/pcie.json" > "$O/pcie.log" 2>&1
# Hand plans at B24 760M under the 24 GiB cap, next to compile + activation_memory_budget=0.
python3 bench/peers.py --sizes 760M --systems compile_amb0 protrain_plan \
  --plan ${PLANS_760:-swap=4,checkpoint=4 swap=4,checkpoint=8 swap=2,checkpoint=12} \
  --cap-gib 24 --out "$O/plans760" --deadline-s $(( $(left) - 200 )) > "$O/plans760.log" 2>&1
# Swap series (same checkpoint count, n_swap varies), uncapped: overlap of the copies.
python3 bench/peers.py --sizes 760M --systems protrain_plan \
  --plan ${SERIES_760:-swap=0,checkpoint=0 swap=2,checkpoint=0 swap=4,checkpoint=0} \
  --cap-gib 0 --out "$O/overlap760" --deadline-s $(( $(left) - 110 )) > "$O/overlap760.log" 2>&1
python3 bench/swap_check.py overlap --runs "$O/overlap760/peers.json" --pcie "$O/pcie.json" --out "$O/overlap.json" > /dev/null 2>&1
timeout $(( $(left) - 60 )) python3 bench/swap_check.py loss --size 125M --plan swap=2,checkpoint=4 --steps 50 --out "$O/loss.json" > "$O/loss.log" 2>&1
timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider tests/test_gpu_swap.py > "$O/pytest_gpu_swap.log" 2>&1
tar czf "$OUT/issue4.tgz" -C "$O" .
cat "$O/pcie.json" "$O/overlap.json" 2>/dev/null; tail -n 12 "$O/plans760/peers.md" "$O/pytest_gpu_swap.log" 2>/dev/null
grep -h '"max_rel_diff"\|within' "$O/loss.json" 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
