#!/usr/bin/env bash
# Last short check of the third session (about 2 device minutes): the swap GPU tests again (issue 4,
# not re-run since the session-2 changes) and DeepSpeed at 350M after its init fix, for its LOSS
# only (run beside the tests, so its tokens/s is not a measurement). Needs .whl/ carried.
set -u
export PYTHONUNBUFFERED=1
O=/tmp/session3c; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
(timeout 100 python3 -m pytest -q tests/test_gpu_swap.py > "$O/pytest_swap.log" 2>&1; echo "pytest exit $?" >> "$O/pytest_swap.log") &
timeout 105 python3 bench/peers.py --sizes 350M --systems deepspeed --deadline-s 100 --default-estimate-s 60 --out "$O" > "$O/peers.log" 2>&1
wait
cp "$O/peers.json" "$O/pytest_swap.log" "$OUT/" 2>/dev/null
tail -n 3 "$O/pytest_swap.log"; grep -E "tok/s|OOM|crash|not_run" "$O/peers.log" | grep -v "^|"
