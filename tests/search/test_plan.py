"""Activation plans (``protrain_fx.plan``): JSON round trip, validation, immutability, the interleaved
layout and ``parse_plan``. Pure Python; no graphs, no device."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import pickle
from pathlib import Path

import pytest

from protrain_fx.plan import PLAN_VERSION, Plan, interleaved, parse_plan

LABELS = [f"blocks.{i}" for i in range(6)]


def _labels(n: int) -> list[str]:
    return [f"transformer.h.{i}" for i in range(n)]


def _sample() -> Plan:
    return Plan(
        blocks={"blocks.2": "checkpoint", "blocks.0": "swap", "blocks.1": "none"},
        tensors={"mm_3": "recompute", "addmm_1": "swap", "gelu": "keep"},
    )


# --------------------------------------------------------------------------- basics


def test_policy_defaults_to_none_and_blocks_with_keeps_order() -> None:
    plan = _sample()
    assert plan.policy("blocks.2") == "checkpoint"
    assert plan.policy("blocks.5") == "none"
    assert plan.blocks_with("swap") == ("blocks.0",)
    assert plan.blocks_with("checkpoint") == ("blocks.2",)
    assert plan.blocks_with("none") == ("blocks.1",)
    assert list(plan.blocks) == ["blocks.2", "blocks.0", "blocks.1"]  # order as given
    assert plan.version == PLAN_VERSION
    with pytest.raises(ValueError, match="'offload'.*'none', 'checkpoint', 'swap'"):
        plan.blocks_with("offload")  # type: ignore[arg-type]


def test_equality_and_hash_ignore_listing_order() -> None:
    a = Plan(blocks={"blocks.0": "swap", "blocks.1": "checkpoint"})
    b = Plan(blocks={"blocks.1": "checkpoint", "blocks.0": "swap"})
    assert a == b and hash(a) == hash(b)
    assert a != Plan(blocks={"blocks.0": "swap"})
    assert len({a, b}) == 1


# --------------------------------------------------------------------------- JSON


def test_json_round_trip_with_overrides() -> None:
    plan = _sample()
    text = plan.to_json()
    data = json.loads(text)
    assert data["version"] == PLAN_VERSION
    assert list(data["blocks"]) == ["blocks.2", "blocks.0", "blocks.1"]  # forward order kept
    assert list(data["tensors"]) == ["addmm_1", "gelu", "mm_3"]  # sorted
    back = Plan.from_json(text)
    assert back == plan
    assert list(back.blocks) == list(plan.blocks)
    assert dict(back.tensors) == dict(plan.tensors)
    assert back.to_json() == text  # stable
    assert Plan.from_dict(plan.to_dict()) == plan


def test_json_round_trip_without_overrides_and_empty_plan() -> None:
    for plan in (Plan(blocks={"blocks.0": "checkpoint"}), Plan(blocks={})):
        assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_json('{"blocks": {"blocks.0": "swap"}}') == Plan(blocks={"blocks.0": "swap"})  # version optional


def test_to_json_is_independent_of_override_order() -> None:
    a = Plan(blocks={}, tensors={"b": "keep", "a": "swap"})
    b = Plan(blocks={}, tensors={"a": "swap", "b": "keep"})
    assert a.to_json() == b.to_json()


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"blocks": {}, "chunks": {}}, r"unknown key 'chunks'; accepted keys: 'version', 'blocks', 'tensors'"),
        ({"version": 1}, r"missing key 'blocks'"),
        ({"version": 2, "blocks": {}}, r"version 2 is not supported; accepted: 1"),
        ({"version": "1", "blocks": {}}, r"version '1' is not supported"),
        ({"version": True, "blocks": {}}, r"version True is not supported"),
        (
            {"blocks": {"blocks.3": "offload"}},
            r"block 'blocks.3' has policy 'offload'; accepted: 'none', 'checkpoint', 'swap'",
        ),
        ({"blocks": {"blocks.3": None}}, r"block 'blocks.3' has policy None"),
        (
            {"blocks": {}, "tensors": {"mm_1": "checkpoint"}},
            r"tensor 'mm_1' has policy 'checkpoint'; accepted: 'keep', 'recompute', 'swap'",
        ),
        ({"blocks": ["blocks.0"]}, r"'blocks' must be a mapping"),
        ({"blocks": {"": "swap"}}, r"non-empty strings"),
        ({"blocks": {3: "swap"}}, r"non-empty strings, got 3"),
    ],
)
def test_from_dict_errors_name_the_problem(data, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        Plan.from_dict(data)


def test_constructor_checks_like_from_dict() -> None:
    with pytest.raises(ValueError, match="'blocks.0' has policy 'recompute'"):
        Plan(blocks={"blocks.0": "recompute"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="version 0"):
        Plan(blocks={}, version=0)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("{not json", r"not valid JSON"),
        ("[1, 2]", r"expected a mapping"),
        ('{"blocks": {"blocks.0": "swap", "blocks.0": "none"}}', r"key 'blocks.0' appears more than once"),
    ],
)
def test_from_json_errors(text, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        Plan.from_json(text)


# --------------------------------------------------------------------------- validate


def test_validate_accepts_known_blocks_and_tensors() -> None:
    plan = _sample()
    assert plan.validate(LABELS) is plan  # overrides unchecked without tensor names
    assert plan.validate(LABELS, {"mm_3", "addmm_1", "gelu", "other"}) is plan


def test_validate_unknown_block_lists_the_known_ones() -> None:
    plan = Plan(blocks={"blocks.9": "checkpoint", "blocks.1": "none"})
    with pytest.raises(ValueError) as info:
        plan.validate(LABELS)
    message = str(info.value)
    assert "unknown block 'blocks.9'" in message
    for label in LABELS:
        assert repr(label) in message


def test_validate_many_unknown_blocks_and_long_label_lists() -> None:
    plan = Plan(blocks={"layers.0": "swap", "layers.1": "swap"})
    with pytest.raises(ValueError, match=r"unknown blocks 'layers.0', 'layers.1'.*\(80 blocks\)"):
        plan.validate(_labels(80))
    with pytest.raises(ValueError, match="the model has no repeated blocks"):
        plan.validate([])


def test_validate_unknown_tensor() -> None:
    plan = Plan(blocks={}, tensors={"mm_33": "recompute"})
    with pytest.raises(ValueError, match=r"unknown saved tensor 'mm_33' \(did you mean 'mm_3'\?\)"):
        plan.validate(LABELS, ["mm_3", "addmm_1"])


# --------------------------------------------------------------------------- immutability


def test_plan_is_immutable() -> None:
    source = {"blocks.0": "swap"}
    plan = Plan(blocks=source, tensors={"mm_3": "keep"})
    source["blocks.1"] = "checkpoint"  # the plan holds its own copy
    assert dict(plan.blocks) == {"blocks.0": "swap"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.blocks = {}  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.version = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.blocks["blocks.0"] = "none"  # type: ignore[index]
    with pytest.raises(TypeError):
        del plan.blocks["blocks.0"]  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        plan.tensors["mm_3"] = "swap"  # type: ignore[index]
    with pytest.raises(AttributeError):
        plan.blocks.clear()  # type: ignore[attr-defined]
    assert plan == Plan(blocks={"blocks.0": "swap"}, tensors={"mm_3": "keep"})


def test_plan_copies_pickles_and_replaces() -> None:
    plan = _sample()
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert copy.deepcopy(plan) == plan
    assert copy.copy(plan) == plan
    changed = dataclasses.replace(plan, tensors={})
    assert changed.tensors == {} and changed.blocks == plan.blocks
    with pytest.raises(TypeError):
        changed.tensors["x"] = "keep"  # type: ignore[index]


# --------------------------------------------------------------------------- table


def test_table_lists_blocks_and_overrides() -> None:
    plan = Plan(blocks={"blocks.1": "checkpoint", "blocks.7": "swap"}, tensors={"mm_3": "recompute"})
    text = plan.table(LABELS[:3])
    lines = text.splitlines()
    assert "3 blocks (0 swap, 1 checkpoint, 2 none)" in lines[0]
    assert [ln.split()[:2] for ln in lines if ln.strip().startswith("blocks.")] == [
        ["blocks.0", "none"],
        ["blocks.1", "checkpoint"],
        ["blocks.2", "none"],
        ["blocks.7", "swap"],
    ]
    assert "not in model" in next(ln for ln in lines if "blocks.7" in ln)
    assert "per-tensor overrides (1)" in text
    assert any(ln.split() == ["mm_3", "recompute"] for ln in lines)
    assert str(plan) == plan.table()
    assert "blocks.0" not in str(plan)  # without labels: only the plan's own blocks


# --------------------------------------------------------------------------- interleaved


CASES = [
    (L, s, c)
    for L in (0, 1, 2, 3, 4, 5, 7, 8, 12, 13, 24, 32, 48, 80)
    for s in sorted({0, 1, 2, L // 3, L // 2, L - 1, L})
    for c in sorted({0, 1, 2, 3, (L - s) // 3, (L - s) // 2, L - s - 2, L - s - 1, L - s})
    if 0 <= s <= L and 0 <= c <= L - s
]


@pytest.mark.parametrize(("n_blocks", "n_swap", "n_checkpoint"), CASES)
def test_interleaved_properties(n_blocks, n_swap, n_checkpoint) -> None:
    labels = _labels(n_blocks)
    plan = interleaved(labels, n_swap, n_checkpoint)
    policies = [plan.policy(label) for label in labels]
    rest = n_blocks - n_swap

    assert list(plan.blocks) == labels  # every block listed, in forward order
    assert policies.count("swap") == n_swap
    assert policies.count("checkpoint") == n_checkpoint
    assert policies.count("none") == rest - n_checkpoint
    assert plan.blocks_with("swap") == tuple(labels[:n_swap])  # exactly the first n_swap

    positions = [i - n_swap for i, p in enumerate(policies) if p == "checkpoint"]
    if n_checkpoint:
        assert positions[0] == 0  # checkpoints start right after the swapped blocks
        gaps = [b - a for a, b in itertools.pairwise(positions)]
        tail = rest - positions[-1]  # the last checkpoint block and the "none" blocks after it
        spans = gaps + [tail]
        assert max(spans) - min(spans) <= 1  # evenly spread: gaps differ by at most one
        assert spans == sorted(spans)  # short gaps first: "none" blocks lean toward the end
    if n_checkpoint < rest:
        assert policies[-1] == "none"


@pytest.mark.parametrize(
    ("n_blocks", "n_swap", "n_checkpoint", "expected"),
    [
        (0, 0, 0, ""),
        (4, 4, 0, "SSSS"),
        (4, 0, 4, "CCCC"),
        (4, 0, 0, "NNNN"),
        (4, 1, 3, "SCCC"),
        (6, 2, 2, "SSCNCN"),
        (10, 2, 3, "SSCNCNNCNN"),
        (10, 0, 4, "CNCNCNNCNN"),
        (8, 0, 1, "CNNNNNNN"),
        (8, 0, 7, "CCCCCCCN"),
        (12, 3, 6, "SSSCCCCNCNCN"),
    ],
)
def test_interleaved_layouts(n_blocks, n_swap, n_checkpoint, expected) -> None:
    labels = _labels(n_blocks)
    plan = interleaved(labels, n_swap=n_swap, n_checkpoint=n_checkpoint)
    assert "".join(plan.policy(label)[0].upper() for label in labels) == expected


@pytest.mark.parametrize(
    ("n_blocks", "n_swap", "n_checkpoint", "pattern"),
    [
        (4, -1, 0, r"n_swap must be 0 or more, got -1"),
        (4, 0, -2, r"n_checkpoint must be 0 or more, got -2"),
        (4, 3, 2, r"n_swap \(3\) \+ n_checkpoint \(2\) = 5 exceeds the 4 blocks"),
        (0, 1, 0, r"n_swap \(1\) \+ n_checkpoint \(0\) = 1 exceeds the 0 blocks"),
        (4, 1.0, 0, r"n_swap must be an int, got 1.0"),
        (4, 0, True, r"n_checkpoint must be an int, got True"),
    ],
)
def test_interleaved_errors(n_blocks, n_swap, n_checkpoint, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        interleaved(_labels(n_blocks), n_swap, n_checkpoint)


def test_interleaved_rejects_repeated_labels() -> None:
    with pytest.raises(ValueError, match="repeated block label 'blocks.1'"):
        interleaved(["blocks.0", "blocks.1", "blocks.1"], 0, 1)


# --------------------------------------------------------------------------- parse_plan


def test_parse_plan_accepts_each_kind(tmp_path: Path) -> None:
    plan = _sample()
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json() + "\n")
    assert parse_plan(plan) is plan
    assert parse_plan(plan.to_dict()) == plan
    assert parse_plan({"blocks": {"blocks.0": "checkpoint"}}) == Plan(blocks={"blocks.0": "checkpoint"})
    assert parse_plan(plan.to_json()) == plan
    assert parse_plan(str(path)) == plan
    assert parse_plan(path) == plan  # os.PathLike


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        (42, r"option 'plan': got 42 \(int\); accepted: a Plan, a dict"),
        (None, r"option 'plan': got None"),
        (["blocks.0"], r"option 'plan': got \['blocks.0'\]"),
        ("checkpoint everything", r"neither JSON text nor a .json path"),
        ({"blocks": {"blocks.0": "offload"}}, r"option 'plan': plan: block 'blocks.0' has policy 'offload'"),
        ('{"blocks": {}, "bogus": 1}', r"option 'plan': plan: unknown key 'bogus'"),
        ("/nonexistent/dir/plan.json", r"cannot read plan file '/nonexistent/dir/plan.json'"),
    ],
)
def test_parse_plan_errors(value, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        parse_plan(value)


def test_parse_plan_bad_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"version": 9, "blocks": {}}')
    with pytest.raises(ValueError, match=r"file '.*bad.json'.*version 9 is not supported"):
        parse_plan(path)


def test_plans_from_counts_specs():
    from protrain_fx.plan import from_counts, parse_counts

    labels = [f"blocks.{i}" for i in range(6)]
    assert from_counts("swap=1,checkpoint=2", labels) == interleaved(labels, 1, 2)
    assert from_counts("checkpoint=all", labels) == interleaved(labels, 0, 6)
    assert from_counts("swap=2,checkpoint=all", labels) == interleaved(labels, 2, 4)
    assert parse_counts("swap=3") == (3, 0)
    for bad in ("swap=x", "swapp=1", "swap=all,checkpoint=all", "swap=1,swap=2"):
        with pytest.raises(ValueError, match="plan spec"):
            parse_counts(bad)
