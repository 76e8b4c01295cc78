"""Parsing and validation of ``torch.compile(..., backend="protrain", options={...})``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from protrain_fx import ProtrainConfig, parse_bytes, parse_options
from protrain_fx.config import config_as_options

ACCEPTED_OPTIONS = ("auto_plan", "codegen", "keep_node_order", "memory_budget", "optimizer", "verbose")


# --------------------------------------------------------------------------- parse_bytes


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("24GiB", 24 * 2**30),
        ("500MB", 500 * 10**6),
        ("1.5 GiB", int(1.5 * 2**30)),
        ("1.5GiB", 1_610_612_736),
        (" 2 kib ", 2048),
        ("3kB", 3000),
        ("7", 7),
        ("7B", 7),
        ("1TiB", 2**40),
        ("1TB", 10**12),
        (1024, 1024),
        (1, 1),
        (2**41, 2**41),
        (4096.0, 4096),
    ],
)
def test_parse_bytes_accepts(value, expected) -> None:
    n = parse_bytes(value)
    assert n == expected
    assert type(n) is int


@pytest.mark.parametrize(
    "value",
    ["lots", -1, 0, True, False, "12 parsecs", [1, 2], "-5GB", "0", "0GiB", "", "1e9", 1.5, None, {"GiB": 1}],
)
def test_parse_bytes_rejects(value) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(value, option="memory_budget")
    message = str(info.value)
    assert "'memory_budget'" in message
    assert "accepted" in message or "positive" in message


@pytest.mark.parametrize("value", [-1, "-5GB", "-1 GiB", "0", 0])
def test_a_size_below_one_byte_is_told_it_must_be_positive(value) -> None:
    with pytest.raises(ValueError, match="the size must be positive"):
        parse_bytes(value, option="memory_budget")


@pytest.mark.parametrize("value", ["lots", True, "12 parsecs", [1, 2], 1.5])
def test_parse_bytes_message_lists_accepted_forms(value) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(value, option="memory_budget")
    message = str(info.value)
    assert "accepted" in message and "GiB" in message and repr(value) in message


@pytest.mark.parametrize("value", [-1, 0, "0MB"])
def test_parse_bytes_non_positive_says_positive(value) -> None:
    with pytest.raises(ValueError, match="positive") as info:
        parse_bytes(value, option="memory_budget")
    assert "'memory_budget'" in str(info.value)


def test_parse_bytes_names_the_option_given() -> None:
    with pytest.raises(ValueError, match="'my_size'"):
        parse_bytes("lots", option="my_size")


# --------------------------------------------------------------------------- parse_options


def test_defaults() -> None:
    for cfg in (parse_options(None), parse_options({}), ProtrainConfig()):
        assert cfg == ProtrainConfig()
        assert cfg.memory_budget_bytes is None
        assert cfg.codegen == "inductor"
        assert cfg.optimizer == "adamw"
        assert cfg.keep_node_order is True and cfg.verbose is False
        assert cfg.auto_plan is True


def test_parse_options_all_fields() -> None:
    cfg = parse_options(
        {"memory_budget": "24GiB", "codegen": "eager", "optimizer": "sgd_momentum", "keep_node_order": False,
         "verbose": True, "auto_plan": False}
    )
    assert cfg.auto_plan is False
    assert cfg.memory_budget_bytes == 24 * 2**30
    assert cfg.codegen == "eager"
    assert cfg.optimizer == "sgd_momentum" and cfg.optimizer_states_per_param == 1
    assert cfg.keep_node_order is False and cfg.verbose is True
    assert parse_options(config_as_options(cfg)) == cfg


@pytest.mark.parametrize(
    ("budget", "expected"), [("500MB", 500 * 10**6), ("1.5 GiB", int(1.5 * 2**30)), (123456, 123456), (None, None)]
)
def test_parse_options_memory_budget(budget, expected) -> None:
    assert parse_options({"memory_budget": budget}).memory_budget_bytes == expected


@pytest.mark.parametrize(("optimizer", "states"), [("adamw", 2), ("adam", 2), ("sgd", 0), ("sgd_momentum", 1), ("none", 0)])
def test_optimizer_states_per_param(optimizer, states) -> None:
    assert parse_options({"optimizer": optimizer}).optimizer_states_per_param == states


@pytest.mark.parametrize("value", ["lots", -1, 0, True, "12 parsecs", [24, "GiB"]])
def test_bad_memory_budget_raises(value) -> None:
    with pytest.raises(ValueError) as info:
        parse_options({"memory_budget": value})
    message = str(info.value)
    assert "memory_budget" in message
    assert "accepted" in message or "positive" in message


def test_unknown_option_is_named_and_accepted_ones_listed() -> None:
    with pytest.raises(ValueError) as info:
        parse_options({"budget": 1})
    message = str(info.value)
    assert "'budget'" in message
    for name in ACCEPTED_OPTIONS:
        assert name in message


@pytest.mark.parametrize(
    ("options", "name", "accepted"),
    [
        ({"codegen": "triton"}, "codegen", ("'inductor'", "'eager'")),
        ({"codegen": None}, "codegen", ("'inductor'", "'eager'")),
        ({"codegen": "Eager"}, "codegen", ("'inductor'", "'eager'")),
        ({"optimizer": "lion"}, "optimizer", ("'adamw'", "'adam'", "'sgd'", "'sgd_momentum'", "'none'")),
        ({"optimizer": "AdamW"}, "optimizer", ("'adamw'",)),
        ({"keep_node_order": "yes"}, "keep_node_order", ("True or False",)),
        ({"verbose": 1}, "verbose", ("True or False",)),
        ({"auto_plan": "none"}, "auto_plan", ("True or False",)),
        ({"auto_plan": None}, "auto_plan", ("True or False",)),
    ],
)
def test_bad_choice_values(options, name, accepted) -> None:
    with pytest.raises(ValueError) as info:
        parse_options(options)
    message = str(info.value)
    assert f"'{name}'" in message and "accepted" in message
    for word in accepted:
        assert word in message


@pytest.mark.parametrize("options", [["codegen", "eager"], "codegen=eager", 3])
def test_options_must_be_a_mapping(options) -> None:
    with pytest.raises(ValueError, match="options must be a dict"):
        parse_options(options)


def test_config_object_is_accepted_and_validated() -> None:
    cfg = ProtrainConfig(codegen="eager", memory_budget_bytes=2**30)
    assert parse_options(cfg) is cfg
    with pytest.raises(ValueError, match="'codegen'"):
        parse_options(ProtrainConfig(codegen="cuda"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'memory_budget'"):
        parse_options(ProtrainConfig(memory_budget_bytes=-5))


def test_config_object_budget_is_normalised_to_int() -> None:
    try:
        cfg = parse_options(ProtrainConfig(memory_budget_bytes="24GiB"))  # type: ignore[arg-type]
    except ValueError:
        return  # rejecting it is fine too
    assert cfg.memory_budget_bytes == 24 * 2**30 and type(cfg.memory_budget_bytes) is int


def test_config_is_frozen() -> None:
    cfg = parse_options({"codegen": "eager"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.codegen = "inductor"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.memory_budget_bytes = 1  # type: ignore[misc]
    assert cfg.codegen == "eager"


# --------------------------------------------------------------------------- through torch.compile


def _exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and everything it wraps (``__cause__``, ``__context__``, Dynamo's ``inner_exception``)."""
    chain, todo = [], [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is seen for seen in chain):
            continue
        chain.append(e)
        todo += [e.__cause__, e.__context__, getattr(e, "inner_exception", None)]
    return chain


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"memory_budget": "lots"}, ("'memory_budget'", "cannot read 'lots'", "accepted", "GiB")),
        ({"memory_budget": -1}, ("'memory_budget'", "positive")),
        ({"memory_budget": True}, ("'memory_budget'", "accepted")),
        ({"budget": 1}, ("unknown protrain option 'budget'", "accepted options", *ACCEPTED_OPTIONS)),
        ({"codegen": "triton"}, ("'codegen'", "'triton'", "'inductor'", "'eager'")),
        ({"optimizer": "lion"}, ("'optimizer'", "'lion'", "'adamw'")),
    ],
)
def test_bad_options_surface_at_first_call(options, expected) -> None:
    model = torch.nn.Linear(3, 2)
    compiled = torch.compile(model, backend="protrain", options=options)  # lazy: nothing raised yet
    with pytest.raises(Exception) as info:
        compiled(torch.randn(4, 3))
    chain = _exception_chain(info.value)
    text = "\n".join(f"{type(e).__name__}: {e}" for e in chain)
    for word in expected:
        assert word in text, text
    # The original error is a ValueError, wherever Dynamo put it (or at least its text survives).
    assert any(isinstance(e, ValueError) for e in chain) or "ValueError" in text, text


def test_mode_is_refused_by_the_backend() -> None:
    compiled = torch.compile(torch.nn.Linear(3, 2), backend="protrain", mode="max-autotune")
    with pytest.raises(Exception) as info:
        compiled(torch.randn(4, 3))
    text = "\n".join(str(e) for e in _exception_chain(info.value))
    assert "takes no mode=" in text and "options=" in text, text


def test_good_options_compile_and_are_recorded() -> None:
    import protrain_fx

    model = torch.nn.Linear(3, 2)
    compiled = torch.compile(
        model, backend="protrain", options={"codegen": "eager", "memory_budget": "1GiB", "optimizer": "sgd"}
    )
    x = torch.randn(4, 3)
    compiled(x).sum().backward()
    (record,) = protrain_fx.captured_graphs()
    assert record.config.codegen == "eager"
    assert record.config.memory_budget_bytes == 2**30
    assert record.config.optimizer == "sgd"
    assert record.memory is not None and record.memory.optimizer_state_bytes == 0


def test_errors_of_ours_reach_the_user_as_themselves() -> None:
    """No Dynamo wrapper and no "report a bug to PyTorch" footer: ``except ValueError`` and ``except
    NoPlanFits`` around a training step catch them."""
    from protrain_fx.search.search import NoPlanFits

    compiled = torch.compile(torch.nn.Linear(3, 2), backend="protrain", options={"codegen": "triton"})
    with pytest.raises(ValueError, match="'codegen'") as info:
        compiled(torch.randn(4, 3))
    assert "reporting a bug" not in str(info.value) and "TORCHDYNAMO_VERBOSE" not in str(info.value)

    from examples.gpt import GPT, gpt_config, random_batch

    torch._dynamo.reset()
    config = gpt_config("tiny", n_layer=3)
    compiled = torch.compile(GPT(config), backend="protrain", options={"codegen": "eager", "memory_budget": 1000})
    with pytest.raises(NoPlanFits) as info:
        compiled(*random_batch(config, 2, 16)).backward()
    error = info.value
    assert isinstance(error, ValueError) and error.min_budget_bytes > 1000
    assert "reporting a bug" not in str(error) and f"{error.min_budget_bytes} bytes" in str(error)


def test_an_absurd_budget_is_planned_for_at_once() -> None:
    from protrain_fx.planner.budget import (
        allocated_cap_bytes,
        budget_for_peak,
        budget_verdict,
    )

    huge = int(1e99)
    assert budget_verdict(allocated_cap_bytes(huge), huge) == "fits"
    assert budget_verdict(allocated_cap_bytes(huge) + 1, huge) != "fits"
    assert budget_for_peak(allocated_cap_bytes(huge)) <= huge
    compiled = torch.compile(torch.nn.Linear(3, 2), backend="protrain", options={"codegen": "eager",
                                                                                 "memory_budget": 1e99})
    compiled(torch.randn(4, 3)).sum().backward()  # fits as it is: no hang


def test_a_graph_break_inside_a_block_is_counted_and_named(monkeypatch) -> None:
    import protrain_fx
    from examples import gpt

    forward = gpt.Block.forward

    def talkative(self, x):
        x = forward(self, x)
        print("block done")  # a graph break inside every block
        return x

    monkeypatch.setattr(gpt.Block, "forward", talkative)
    config = gpt.gpt_config("tiny", n_layer=3)
    compiled = torch.compile(gpt.GPT(config), backend="protrain", options={"codegen": "eager"})
    compiled(*gpt.random_batch(config, 2, 16)).backward()
    report = protrain_fx.step_report()
    breaks = [b for g in report.graphs for b in g.breaks]
    assert breaks and breaks[0].inside_block.startswith("blocks.") and "talkative" in breaks[0].where
    assert "inside transformer blocks" in report.summary()


def test_a_bad_option_is_raised_as_itself_under_a_short_traceback():
    """The first call compiles, inside Dynamo; the option's error reaches the user as a ``ValueError``
    whose traceback goes from the call straight into the backend, without Dynamo's own frames."""
    import traceback

    from examples.gpt import GPT, gpt_config, random_batch

    config = gpt_config("tiny")
    x, y = random_batch(config, 2, 16)
    with pytest.raises(ValueError, match="option 'memory_budget': cannot read 'lots' as a size") as raised:
        torch.compile(GPT(config), backend="protrain", options={"memory_budget": "lots"})(x, y)
    frames = traceback.extract_tb(raised.value.__traceback__)
    assert not any("convert_frame" in f.filename or "output_graph" in f.filename for f in frames)
    assert len(frames) <= 15 and frames[-1].filename.endswith("backend.py")


def test_no_plan_fits_comes_under_the_call_and_the_backend_only():
    """A budget too small is found deep inside AOTAutograd's partitioner: its frames, and the planner's,
    are cut from what the user sees (the message names the smallest budget); TORCHDYNAMO_VERBOSE keeps
    them."""
    import traceback

    from examples.gpt import GPT, gpt_config, random_batch
    from protrain_fx.search.search import NoPlanFits

    config = gpt_config("tiny")
    x, y = random_batch(config, 2, 16)
    lengths = {}
    for verbose in (False, True):
        torch._dynamo.reset()
        with torch._dynamo.config.patch(verbose=verbose), pytest.raises(NoPlanFits, match="must be at least") as raised:
            torch.compile(GPT(config), backend="protrain", options={"memory_budget": 1024, "codegen": "eager"})(x, y)
        frames = traceback.extract_tb(raised.value.__traceback__)
        lengths[verbose] = len(frames)
        assert frames[0].filename == __file__
    assert lengths[False] <= 8 < lengths[True]  # the call, torch.compile's wrappers, the backend
