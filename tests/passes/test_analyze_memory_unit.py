"""``analyze_memory`` on the hand-built two-block step (``tests/passes/graphs.py``): one 512x512
fp32 value is 1 MiB, so the prediction is checked in whole MiB against bytes counted by hand."""

from __future__ import annotations

import dataclasses

import pytest

from protrain_fx.config import ProtrainConfig
from protrain_fx.passes.pipeline import PassContext, analyze_memory, attribute_blocks, run_passes
from tests.passes.graphs import MiB, graph_text, record_for, trace
from protrain_fx import settings


def test_the_step_is_analysed_into_the_record():
    _, forward, backward = trace()
    record = record_for(forward, backward)
    before = graph_text(forward, backward)
    record.rewritten = run_passes([attribute_blocks, analyze_memory], PassContext(record))
    m = record.memory
    # model state: two weights, their gradients and AdamW's two states each; the batch x
    assert (m.parameter_bytes, m.gradient_bytes, m.optimizer_state_bytes, m.input_bytes) == (
        2 * MiB, 2 * MiB, 4 * MiB, MiB)
    assert m.saved_activation_bytes == 2 * MiB  # relu and relu_1, for threshold_backward
    # the peak, at mm_3: 7 MiB of state and batch, relu (saved), threshold_backward, mm_2 (w1's
    # gradient), mm_3, and the 4-byte tangent of the loss
    assert m.peak_entry.name == "mm_3" and m.peak_bytes == 11 * MiB + 4
    assert [b.block for b in m.blocks][:2] == ["blocks.0", "blocks.1"]
    assert record.step.offload == {}  # no chunk gathers: no offload handle to describe
    assert record.passes[-1].summary == "predicted peak 11.0 MiB on cpu (params 2.0, saved 2.0 MiB)"
    assert graph_text(forward, backward) == before  # an analysis: the graphs are as they were


def test_the_optimizer_option_sets_the_state_counted():
    _, forward, backward = trace()
    record = record_for(forward, backward, config=ProtrainConfig(optimizer="sgd"))
    record.rewritten = run_passes([analyze_memory], PassContext(record))
    assert record.memory.optimizer_state_bytes == 0


def test_nothing_to_do_without_a_step():
    _, forward, backward = trace()
    record = record_for(forward, backward)
    record.rewritten = dataclasses.replace(record.rewritten, step=None)
    record.rewritten = run_passes([analyze_memory], PassContext(record))
    assert record.memory is None and record.passes == []


def test_an_analysis_cannot_be_disabled(monkeypatch):
    monkeypatch.setenv(settings.DISABLE_PASSES, "analyze_memory")
    _, forward, backward = trace()
    with pytest.raises(ValueError, match="analyze_memory cannot be disabled"):
        run_passes([analyze_memory], PassContext(record_for(forward, backward)))
