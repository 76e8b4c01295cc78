"""Chunk layout properties (issue 5, first part): order, no overlap, tied once, blocks together,
least waste."""

from __future__ import annotations

import random

import pytest

from protrain_fx.chunks import (
    ChunkLayout,
    MiB,
    ParamInfo,
    choose_layout,
    dedupe_tied,
    pack,
)


def _gpt_like(n_blocks: int, d: int, vocab: int = 50304, seed: int = 0) -> list[ParamInfo]:
    """bf16 sizes of a GPT: embedding first, blocks in order (qkv, proj, fc, proj2, norms), final norm."""
    rng = random.Random(seed)
    params, t = [ParamInfo(("wte",), vocab * d * 2, "outside", 0)], 1
    for b in range(n_blocks):
        for name, numel in (("ln1", 2 * d), ("qkv", 3 * d * d + 3 * d), ("proj", d * d + d), ("ln2", 2 * d),
                            ("fc", 4 * d * d + 4 * d), ("proj2", 4 * d * d + d)):
            params.append(ParamInfo((f"blocks.{b}.{name}",), numel * 2, f"blocks.{b}", t))
            t += 1 + rng.randrange(3)
    params.append(ParamInfo(("ln_f",), 2 * d * 2, "outside", t))
    return params


def _check(layout: ChunkLayout, params: list[ParamInfo]) -> None:
    slots = [(c.index, s) for c in layout.chunks for s in c.slots]
    # every parameter exactly once, in first-use order
    assert [s.param for _, s in slots] == sorted(params, key=lambda p: p.first_use)
    for chunk in layout.chunks:
        spans = sorted((s.offset, s.offset + s.param.nbytes) for s in chunk.slots)
        assert spans[0][0] >= 0 and spans[-1][1] <= layout.chunk_bytes  # inside the chunk
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
    # a block that fits a chunk is in one chunk
    for block in {p.block for p in params}:
        members = [p for p in params if p.block == block]
        if sum(p.nbytes for p in members) <= layout.chunk_bytes and block != "outside":
            assert len({layout.chunk_of(p.names[0]) for p in members}) == 1, block


@pytest.mark.parametrize(("n_blocks", "d"), [(12, 768), (24, 1024), (24, 2048), (36, 3072), (2, 64)])
def test_gpt_layouts_keep_order_blocks_and_no_overlap(n_blocks, d):
    params = _gpt_like(n_blocks, d)
    layout = choose_layout(params)
    _check(layout, params)
    # the chosen size wastes no more than any candidate that fits
    for size in (32 * MiB, 64 * MiB, 128 * MiB, 256 * MiB):
        if size >= max(p.nbytes for p in params):
            assert layout.waste_bytes <= pack(params, size).waste_bytes


def test_tied_parameters_take_one_slot_at_first_use():
    rows = [("wte", 1, 100, "outside", 0), ("blocks.0.w", 2, 40, "blocks.0", 1), ("lm_head", 1, 100, "outside", 9)]
    params = dedupe_tied(rows)
    assert len(params) == 2
    tied = next(p for p in params if "wte" in p.names)
    assert tied.names == ("wte", "lm_head") and tied.first_use == 0
    layout = pack(params, 200)
    assert layout.chunk_of("lm_head") == layout.chunk_of("wte") == 0
    assert sum(len(c.slots) for c in layout.chunks) == 2


def test_a_block_that_does_not_fit_the_rest_starts_a_new_chunk():
    params = [ParamInfo(("a",), 60, "blocks.0", 0), ParamInfo(("b",), 30, "blocks.1", 1),
              ParamInfo(("c",), 30, "blocks.1", 2)]
    layout = pack(params, 100)
    assert [[s.param.names[0] for s in c.slots] for c in layout.chunks] == [["a"], ["b", "c"]]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="'big'.*use chunk_bytes >= 500 \\(the largest parameter, 'bigger'\\)"):
        pack([ParamInfo(("big",), 300, "outside", 0), ParamInfo(("bigger",), 500, "outside", 1)], 100)
    with pytest.raises(ValueError, match="positive"):
        pack([], 0)
    with pytest.raises(ValueError, match="no parameters"):
        choose_layout([])


def test_a_parameter_larger_than_every_candidate_gets_chunks_of_its_size():
    params = [ParamInfo(("huge",), 300 * MiB, "outside", 0), ParamInfo(("w",), MiB, "blocks.0", 1)]
    layout = choose_layout(params)
    assert layout.chunk_bytes == 300 * MiB
    _check(layout, params)


def test_layout_of_a_captured_gpt():
    from examples.gpt import example
    from protrain_fx.analysis.params import readable_param_name
    from protrain_fx.inspect.report import inspect_model

    model, batch = example("tiny", batch_size=2, seq_len=16)
    layout = inspect_model(model, *batch, options={"codegen": "eager"}).chunk_layout()
    names = [name for c in layout.chunks for s in c.slots for name in s.param.names]
    expected = {n for n, _ in model.named_parameters()}  # the tied LM head is listed once, as wte
    assert set(names) == expected and len(names) == len(expected)
    assert names.index("blocks.0.ln_1.weight") < names.index("blocks.1.ln_1.weight")
    assert sum(c.used_bytes for c in layout.chunks) == sum(p.numel() * 4 for p in model.parameters())
    assert readable_param_name("L_self_modules_blocks_modules_0_modules_ln_1_parameters_weight_") == "blocks.0.ln_1.weight"


def test_blocks_larger_than_the_fixed_sizes_get_chunks_of_whole_blocks():
    # B24 4.2B in fp32: 453 MB blocks next to a 618 MB tied embedding. At the embedding's size every
    # chunk holds one block and wastes 27%; chunks of two blocks (plus the final norm) waste ~3%.
    params = [ParamInfo(p.names, p.nbytes * 2, p.block, p.first_use) for p in _gpt_like(36, 3072)]
    layout = choose_layout(params)
    _check(layout, params)
    used = sum(p.nbytes for p in params)
    block = sum(p.nbytes for p in params if p.block == "blocks.0")
    assert layout.chunk_bytes >= 2 * block
    assert layout.waste_bytes / used < 0.04
    assert pack(params, max(p.nbytes for p in params)).waste_bytes / used > 0.25


def test_a_model_of_a_few_large_blocks_is_not_laid_out_in_one_chunk():
    # Four 453 MB blocks and their embedding: one chunk of everything would waste nothing and leave
    # nothing to offload (its one buffer holds the whole model); chunks of whole blocks stream.
    params = [ParamInfo(p.names, p.nbytes * 2, p.block, p.first_use) for p in _gpt_like(4, 3072)]
    layout = choose_layout(params)
    _check(layout, params)
    block = sum(p.nbytes for p in params if p.block == "blocks.0")
    assert len(layout.chunks) >= 4 and layout.chunk_bytes < 2 * block
