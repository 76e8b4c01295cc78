"""One B24 table and its plots from the results of several device calls (bench/peers.py's JSON).

    python3 bench/merge_results.py --out docs/b24 docs/raw/A.json docs/raw/B.json ...

Files are read in the order given; a later result for the same (size, system) replaces an earlier one
(a rerun after a fix), except by a ``not_run`` (no result). A file is a ``peers.json`` (a list of results) or a session summary holding
``{"calls": {name: [results] or {lane: [results]}}}``, read in call order. ``--best-of SYSTEM``
keeps, per size, only the fastest successful run of that system over all its settings (e.g. every
``protrain_offload[...]`` hand plan tried), renamed ``SYSTEM[best hand plan]`` with the settings in
``"settings"``; where none succeeded, its last failure is kept. Each result keeps ``"source"``, the
file it came from. Only runs under ``--cap-gib`` (24) are kept. Writes peers.json, peers.md and the two plots of ``bench/peers.py`` into ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location("bench_peers", Path(__file__).with_name("peers.py"))
peers = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(peers)


def read(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    if isinstance(data, list):
        runs = data
    elif isinstance(data, dict) and isinstance(data.get("calls"), dict):
        runs = []
        for call in data["calls"].values():
            runs += call if isinstance(call, list) else [r for lane in call.values() for r in lane]
    else:
        raise SystemExit(f"{path}: neither a list of results nor a session summary with 'calls'")
    return [{**r, "source": path.name} for r in runs]


def merge(paths: list[Path], best_of: list[str], cap_gib: float | None = None) -> list[dict]:
    latest: dict[tuple[str, str], dict] = {}
    for path in paths:
        for r in read(path):
            if cap_gib is not None and r.get("cap_gib") != cap_gib:
                continue  # another protocol (e.g. an uncapped reference run)
            if r["status"] == "not_run" and (r["size"], r["system"]) in latest:
                continue  # left to a later call: not a result
            latest.pop((r["size"], r["system"]), None)  # keep the rerun's position: the newest last
            latest[(r["size"], r["system"])] = r
    out = []
    chosen: dict[tuple[str, str], dict] = {}
    for (size, system), r in latest.items():
        base = peers.base_system(system)
        if base not in best_of:
            out.append(r)
            continue
        key = (size, base)
        best = chosen.get(key)
        ok = r["status"] == "ok"
        if best is None or (ok and (best["status"] != "ok" or r["tokens_per_s"] > best["tokens_per_s"])) or (
            not ok and best["status"] != "ok"
        ):
            chosen[key] = r
    for (size, base), r in chosen.items():
        out.append({**r, "system": f"{base}[best hand plan]", "settings": r["system"]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--best-of", nargs="*", default=[], metavar="SYSTEM")
    parser.add_argument("--cap-gib", type=float, default=24.0, help="keep only runs under this cap (B24: 24)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ledger = peers.Ledger(args.out, merge(args.files, args.best_of, args.cap_gib))
    ledger.write()
    peers.plot(ledger.ordered(), args.out)
    print(peers.markdown(ledger.ordered()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
