"""How much could a per-tensor refinement of the activation plan gain on the recorded runs? (no GPU)

ProTrain's layout gives whole blocks one policy each (swap, checkpoint or keep), and the search
(``protrain_fx/search.py``) picks the counts. A finer plan could keep some of one more checkpointed
block's values in the memory the chosen config leaves under its cap (``plan.Plan.tensors``, per-tensor
overrides, exist for that), saving part of that block's recompute. This prints, for each recorded
automatic run (``bench/peers.py`` JSON files), an upper bound of that saving:

* the slack: the allocated cap less the peak the backend trusted (the graph judge's analysed peak
  where it judged, else the cost model's);
* the bound: checkpointed blocks taken greedily, the most recompute seconds per byte their values
  take when kept (``saved_bytes - checkpoint_saved_bytes``) first, each kept whole while the slack
  lasts and the last one in part (its share of the bytes times its recompute), against the
  predicted step. Per byte no finer plan saves more: the values of a block kept first would be
  those with the most recompute per byte, but the whole block's rate bounds the average, and
  keeping values never adds less to the peak than their bytes. Whole blocks count too: the search
  may have left them because it prices the peak with the cost model, above the judged one.

    python bench/tensor_refinement_bound.py docs/raw/session2[01]_call*_peers.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protrain_fx.cost import Config, CostModel, Problem  # noqa: E402

_CKPT = 1  # cost._CKPT: a checkpointed block's policy


def bound(record: dict) -> dict | None:
    """The bound for one recorded run, or None for a run without an automatic plan."""
    auto = record.get("auto_plan")
    if not auto or not auto.get("problem") or not auto.get("allocated_cap_bytes"):
        return None
    problem, config = Problem.from_dict(auto["problem"]), Config.from_dict(auto["config"])
    model = CostModel(problem)
    peak = auto.get("analysed_peak_bytes") or auto.get("cost_model_peak_bytes")
    slack = max(auto["allocated_cap_bytes"] - peak, 0)
    policies = model.policies(config.n_swap, config.n_checkpoint)
    recompute = model.recomputes(config.n_swap, config.n_checkpoint)
    blocks = sorted(((recompute[i], problem.blocks[i].saved_bytes - problem.blocks[i].checkpoint_saved_bytes)
                     for i, policy in enumerate(policies) if policy == _CKPT),
                    key=lambda x: -x[0] / max(x[1], 1))
    left, saving, whole = slack, 0.0, 0
    for seconds, extra in blocks:
        if extra <= 0:
            saving += seconds
            continue
        if left >= extra:
            left, saving, whole = left - extra, saving + seconds, whole + 1
        else:
            saving += seconds * left / extra
            break
    step = auto.get("predicted_step_s") or model.estimate(config).step_s
    return {"size": record["size"], "cap_gib": record["cap_gib"], "config": config, "slack_bytes": slack,
            "checkpointed": len(blocks), "whole_blocks": whole,
            "block_bytes": statistics.median(x[1] for x in blocks) if blocks else 0,
            "saving_s": saving, "step_s": step}


def main() -> None:
    shares = []
    for name in sys.argv[1:]:
        for record in json.loads(Path(name).read_text()):
            b = bound(record)
            if b is None:
                continue
            c, share = b["config"], b["saving_s"] / b["step_s"]
            shares.append(share)
            block = ("no checkpointed block" if not b["checkpointed"] else
                     f"{b['checkpointed']} checkpointed blocks of ~{b['block_bytes'] / 2**20:.0f} MiB kept each, "
                     f"{b['whole_blocks']} of them whole")
            print(f"{Path(name).name[:34]:34} {b['size']:>5} {b['cap_gib']:3g} GiB {c.n_persist}/{c.n_buffer}/{c.n_swap}/"
                  f"{c.n_checkpoint}/{c.n_gpu_optim}: slack {b['slack_bytes'] / 2**20:6.0f} MiB; {block}; at most "
                  f"{b['saving_s'] * 1e3:.2f} ms of {b['step_s'] * 1e3:.1f} ({100 * share:.2f}%)")
    if shares:
        print(f"{len(shares)} runs: bound median {100 * statistics.median(shares):.2f}%, largest {100 * max(shares):.2f}%")


if __name__ == "__main__":
    main()
