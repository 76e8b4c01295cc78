"""bench/cpu_rate_after_wakeup.py on the CPU: one reading before, the control run (no wake-up)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_reading_names_the_host_state_and_the_rate(tmp_path):
    out = tmp_path / "wake.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_rate_after_wakeup.py"), "--params", str(2**20),
                    "--repeat", "1", "--seconds", "0", "--no-wakeup", "--out", str(out)], check=True, cwd=ROOT)
    data = json.loads(out.read_text())
    assert data["wakeup"] is False and "wakeup_at_s" not in data and data["after"] == []
    (before,) = data["before"]
    assert before["params_per_s"] > 0 and before["t_s"] >= 0
    assert before["busy_elsewhere"] is None or 0 <= before["busy_elsewhere"] <= 1
    assert all(len(top) == 3 for top in before["busiest"])
    assert before["steal"] is None or 0 <= before["steal"] <= 1


def test_steal_is_the_eighth_field_of_the_cpu_line():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import cpu_rate_after_wakeup as bench
    finally:
        sys.path.remove(str(ROOT / "bench"))
    # user nice system idle iowait irq softirq steal: 100 ticks passed, 25 of them stolen
    assert bench.steal_share([10, 0, 5, 80, 0, 0, 0, 5, 0], [50, 0, 10, 110, 0, 0, 0, 30, 0]) == 0.25
    assert bench.steal_share(None, [1] * 8) is None and bench.steal_share([1] * 8, [1] * 8) is None
    assert bench.steal_share([1] * 4, [2] * 4) is None  # an old kernel's line without steal
