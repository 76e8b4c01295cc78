"""Inspection: the block table, readable graphs, the CLI, graph dumps and the budget check."""

from __future__ import annotations

import logging

import pytest
import torch

import protrain_fx
from examples.gpt import example
from protrain_fx.inspect import cli
from protrain_fx.inspect.report import inspect_model
from protrain_fx.planner import budget as planner_budget
from protrain_fx import settings


def test_inspect_model_table_graphs_and_timing():
    model, batch = example("tiny", batch_size=2, seq_len=32)
    grads_before = [p.grad for p in model.parameters()]
    report = inspect_model(model, *batch, options={"codegen": "eager"}, measure_time=True)
    assert [p.grad for p in model.parameters()] == grads_before  # inspection leaves no gradients behind
    table = report.block_table()
    lines = table.splitlines()
    header = next(ln for ln in lines if ln.startswith("block"))
    assert header.split() == ["block", "params", "saved", "act", "transient", "peak", "fw", "nodes", "bw", "nodes", "time"]
    rows = {ln.split()[0]: ln for ln in lines if ln.split() and ln.split()[0] in ("blocks.0", "blocks.1", "outside", "total")}
    assert set(rows) == {"blocks.0", "blocks.1", "outside", "total"}
    shares = [float(rows[b].split()[-1].rstrip("%")) for b in ("blocks.0", "blocks.1", "outside")]
    assert abs(sum(shares) - 100) < 0.5 and all(s > 0 for s in shares)
    memory = report.graphs[0].memory
    assert f"predicted peak {protrain_fx.analysis.readable.human_bytes(memory.peak_bytes)}" in table
    fw, bw = report.forward_graph(), report.backward_graph()
    assert "aten.addmm.default" in fw and "# blocks.1" in fw and "gpt.py:" in fw
    assert "aten.mm.default" in bw and "tangents_1 = placeholder" in bw
    assert str(report).startswith("protrain_fx: 1 graph(s) captured, 0 graph break(s)")


def test_inspect_model_needs_a_scalar():
    model, (idx, _targets) = example("tiny", batch_size=2, seq_len=16)
    try:
        inspect_model(model, idx, options={"codegen": "eager"})
    except ValueError as e:
        assert "scalar" in str(e) and "loss_fn" in str(e)
    else:
        raise AssertionError("logits are not a loss: inspect_model must refuse them")
    report = inspect_model(model, idx, options={"codegen": "eager"}, loss_fn=lambda logits: logits.float().mean())
    assert report.train_graphs


def test_cli_inspect_prints_table_graphs_and_writes_timeline(tmp_path, capsys):
    code = cli.main(
        ["inspect", "examples.gpt:example", "--kw", "size=tiny", "--kw", "seq_len=16", "--option", "codegen=eager",
         "--graphs", "--chunks", "--timeline", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "blocks.0" in out and "outside" in out and "predicted peak" in out
    assert "aten.addmm.default" in out  # --graphs
    assert "1 chunks of 32 MiB" in out  # --chunks: the tiny GPT fits one chunk
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["timeline.json", "timeline.svg", "timeline_predicted.pickle"]


def test_dump_dir_gets_numbered_graphs_after_each_pass(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.DUMP_DIR, str(tmp_path))
    model, batch = example("tiny", batch_size=2, seq_len=16)
    torch.compile(model, backend="protrain", options={"codegen": "eager"})(*batch).backward()
    files = sorted(p.name for p in (tmp_path / "graph0").iterdir())
    assert files[:4] == [
        "01_capture_backward.txt",
        "01_capture_dynamo.txt",
        "01_capture_forward.txt",
        "01_capture_joint.txt",
    ]
    assert "02_attribute_blocks_forward.txt" in files and "03_analyze_memory_backward.txt" in files
    text = (tmp_path / "graph0" / "02_attribute_blocks_forward.txt").read_text()
    assert "# blocks.0" in text  # the pass's annotations are visible in its dump


#: A plan by hand (here: keep everything) turns off the automatic plan: the budget is checked only.
HAND_PLAN = {"blocks": {}}


def test_budget_below_prediction_warns(caplog):
    model, batch = example("tiny", batch_size=2, seq_len=16)
    options = {"codegen": "eager", "memory_budget": "1MiB", "plan": HAND_PLAN}
    with caplog.at_level(logging.WARNING, logger="protrain_fx"):
        torch.compile(model, backend="protrain", options=options)(*batch).backward()
    assert any("over its memory budget of" in r.getMessage() for r in caplog.records)
    table = protrain_fx.step_report().block_table()
    assert "budget 1.00 MiB: DOES NOT FIT" in table


def test_verbose_prints_one_line_per_pass(capfd):
    model, batch = example("tiny", batch_size=2, seq_len=16)
    torch.compile(model, backend="protrain", options={"codegen": "eager", "verbose": True})(*batch).backward()
    err = capfd.readouterr().err
    assert "attribute_blocks" in err and "analyze_memory" in err and "predicted peak" in err


def test_budget_verdict_keeps_the_allocators_headroom():
    from protrain_fx.planner.budget import ALLOCATOR_HEADROOM, budget_verdict

    gib = 2**30
    assert budget_verdict(10 * gib, 20 * gib) == "fits"
    # 19.2 GiB predicted under a 20 GiB cap ran out of memory on the H200 (reserved ~1 GiB more)
    assert budget_verdict(int(19.2 * gib), 20 * gib) == "tight"
    assert budget_verdict(21 * gib, 20 * gib) == "over"
    edge = int(20 * gib / (1 + ALLOCATOR_HEADROOM))
    assert budget_verdict(edge, 20 * gib) == "fits" and budget_verdict(edge + 2**20, 20 * gib) == "tight"


def test_tight_budget_is_reported(caplog):
    model, batch = example("tiny", batch_size=2, seq_len=16)
    torch.compile(model, backend="protrain", options={"codegen": "eager"})(*batch).backward()
    peak = protrain_fx.captured_graphs()[-1].memory.peak_bytes
    protrain_fx.reset()
    torch._dynamo.reset()
    model, batch = example("tiny", batch_size=2, seq_len=16)
    with caplog.at_level(logging.WARNING, logger="protrain_fx"):
        torch.compile(
            model, backend="protrain", options={"codegen": "eager", "memory_budget": peak + 1, "plan": HAND_PLAN}
        )(*batch).backward()
    assert any("at the edge of its memory budget" in r.getMessage() for r in caplog.records)
    assert "TIGHT" in protrain_fx.step_report().block_table()


def test_without_a_budget_a_peak_over_the_gpus_allowed_memory_warns(monkeypatch, caplog):
    from types import SimpleNamespace

    from protrain_fx.config import ProtrainConfig

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=140 * gib))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 24 / 140)
    assert planner_budget.device_limit_bytes("cuda:0") == 24 * gib
    assert planner_budget.device_limit_bytes("cpu") is None

    def record(peak: int, device: str):
        return SimpleNamespace(config=ProtrainConfig(), index=0, memory=SimpleNamespace(peak_bytes=peak, device=device),
                               blocks=None, budget=None, budget_bytes=None)

    with caplog.at_level(logging.WARNING, logger="protrain_fx"):
        # 6.7B with chunks on the H200: 27.8 GiB predicted under a 24 GiB cap, and it ran out of memory
        planner_budget.check_budget(record(int(27.8 * gib), "cuda:0"))
        planner_budget.check_budget(record(10 * gib, "cuda:0"))  # fits: silent
        planner_budget.check_budget(record(100 * gib, "cpu"))  # no limit known: silent
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert "over the memory this process may use on cuda:0 of 24.00 GiB" in messages[0]
    assert "no repeated layers found in this graph" in messages[0] and "protrain_fx.offload" in messages[0]


def test_sizes_read_as_sizes_from_bytes_to_budgets_no_host_holds():
    from protrain_fx.analysis.readable import human_bytes

    assert human_bytes(12) == "12 B" and human_bytes(512 * 1024) == "512.00 KiB"
    assert human_bytes(3 * 2**29) == "1.50 GiB" and human_bytes(2**41) == "2.00 TiB"
    assert human_bytes(10**90) == "9.09e+77 TiB"  # a budget typed with too many digits: still one short number


def test_a_graph_without_blocks_over_the_budget_it_was_asked_to_fit_is_refused_naming_the_minimum():
    """No repeated layers to checkpoint or swap, and a memory budget the step cannot meet: the compile
    is refused with the smallest budget for the step as it is (a budget only checked, as with a plan
    by hand or auto_plan=False, still warns)."""
    from protrain_fx.planner.budget import budget_for_peak
    from protrain_fx.search.search import NoPlanFits

    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    with pytest.raises(NoPlanFits, match="no repeated layers in this graph") as refused:
        torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": 4096})(x).sum().backward()
    (record,) = protrain_fx.captured_graphs()
    assert refused.value.min_budget_bytes == budget_for_peak(record.memory.peak_bytes) > 4096
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": 4096, "auto_plan": False})(
        x).sum().backward()  # only checked: a warning, and it runs
