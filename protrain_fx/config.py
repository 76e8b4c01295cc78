"""User configuration: the ``options=`` dict of ``torch.compile`` parsed into frozen objects.

Every option is validated here and nowhere else; a bad name or value raises ``ValueError`` naming
the option and what it accepts. Nothing in this module reads the environment.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Mapping

from protrain_fx.machine import CPU
from protrain_fx.plan import parse_plan

if TYPE_CHECKING:
    from protrain_fx.plan import Plan

Codegen = Literal["inductor", "eager"]
OptimizerKind = Literal["adamw", "adam", "sgd", "sgd_momentum", "none"]
Verify = Literal["auto", "graph", "inductor"]

#: Optimizer state tensors kept per parameter, each shaped and typed like the parameter
#: (what ``torch.optim`` allocates: ``exp_avg``/``exp_avg_sq`` for Adam(W), ``momentum_buffer`` for SGD).
OPTIMIZER_STATES_PER_PARAM: dict[str, int] = {
    "adamw": 2,
    "adam": 2,
    "sgd": 0,
    "sgd_momentum": 1,
    "none": 0,
}

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")  # (a sign: told it must be positive)


def is_count(value: Any, minimum: int = 0) -> bool:
    """Whether ``value`` is an int (not a bool) of at least ``minimum``: what every count option takes."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def parse_bytes(value: Any, *, option: str = "memory_budget") -> int:
    """Turn ``1024``, ``"500MB"``, ``"24GiB"`` or ``"1.5 GiB"`` into a positive number of bytes.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers of 1024.
    """
    accepted = "a positive number of bytes (int) or a string such as '24GiB', '500MB', '1.5 GiB'"
    if isinstance(value, bool):
        raise ValueError(f"option {option!r}: got {value!r}; accepted: {accepted}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _BYTES_RE.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ValueError(
                f"option {option!r}: cannot read {value!r} as a size; accepted: {accepted} "
                f"(units: {', '.join(u for u in ('B', 'kB', 'MB', 'GB', 'TB', 'KiB', 'MiB', 'GiB', 'TiB'))})"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"option {option!r}: got {value!r} ({type(value).__name__}); accepted: {accepted}")
    if n <= 0:
        raise ValueError(f"option {option!r}: got {value!r}; the size must be positive")
    return n


@dataclass(frozen=True, kw_only=True)
class ProtrainConfig:
    """Everything the backend can be told through ``torch.compile(..., options={...})``.

    Attributes:
        memory_budget_bytes: GPU bytes the training step may use (``None``: no budget). Without a
            ``plan``, for a model whose parameters stay on the device, the backend chooses the
            activation plan that fits it (``planner/activations.py``); otherwise it is checked against
            the predicted peak and a warning names the gap.
        codegen: ``"inductor"`` (default) compiles the captured graphs with Inductor keeping our node
            order; ``"eager"`` runs them as plain FX code (bit-exact with eager PyTorch; for debugging
            and fast tests).
        optimizer: which optimizer's state the memory analysis counts (states per parameter, each
            shaped and typed like the parameter): adamw/adam 2, sgd_momentum 1, sgd/none 0.
        keep_node_order: with Inductor, turn off its ``reorder_for_peak_memory`` so the kernels run in
            the order our analysis (and later our rewrites) assumed.
        verbose: log one line per captured graph and per pass.
        plan: an activation plan given by hand (per block: none / checkpoint / swap), applied to
            every captured graph; see ``protrain_fx.plan``.
        machine: overrides of the machine constants the rewrites place copies with (e.g.
            ``{"h2d_bytes": 25e9, "d2h_bytes": 25e9}`` for a PCIe Gen4 card; ``{"host_memory_apart": True}``
            lets the automatic plans swap on the CPU as on a card); see ``protrain_fx.machine``.
        auto_plan: ``True`` (default): the backend chooses the activation plan when it has a budget:
            ``memory_budget``, or without one, for a step on a CUDA device, the memory this process can
            still reach there (``planner/budget.device_budget_bytes``). ``False``: it never chooses one; no
            budget is taken from the device, and a ``memory_budget`` is only checked against the
            prediction (as with a ``plan`` by hand). For runs that must compile exactly as written
            (the automatic plan specialises the graph to its input shapes).
        dry_run: set by :func:`protrain_fx.what_fits`: the backend plans the step and stops the compile
            with its report; nothing runs.
        verify: how a plan the backend tries is checked against the budget. ``"graph"``: the
            graph-level memory analysis, which counts every value of the graphs. ``"inductor"``
            (Inductor codegen only): each plan tried is lowered with Inductor, as the compile will
            lower it, and judged by Inductor's allocation plan, the one that runs
            (``planner/verify.judged_peak``). Inductor never stores most pointwise values, so the
            graph-level analysis overstates a compiled step's peak, and near the limit only this
            judge keeps every parameter on the device, the faster plan
            (``docs/results.md#which-analysis-judges-a-plan``). Each plan tried costs one extra
            lowering of both graphs (tens of seconds on the first step of a large model). ``"auto"`` (default):
            ``"inductor"`` for a step on a CUDA device compiled with Inductor, ``"graph"`` otherwise
            (:meth:`verify_for`).
        accumulation_steps: micro-batches per optimizer step (gradient accumulation): each training
            call of the graph is one micro-batch, and the plan chosen is the fastest for the whole
            accumulated step (``search.problem.Problem.accumulation``). Default 1.
    """

    memory_budget_bytes: int | None = None
    codegen: Codegen = "inductor"
    optimizer: OptimizerKind = "adamw"
    keep_node_order: bool = True
    verbose: bool = False
    plan: "Plan | None" = None
    machine: Mapping[str, float | bool] | None = None
    auto_plan: bool = True
    dry_run: bool = False
    verify: Verify = "auto"
    accumulation_steps: int = 1

    def __post_init__(self) -> None:
        if self.memory_budget_bytes is not None:  # "24GiB" given to the class directly
            object.__setattr__(self, "memory_budget_bytes", parse_bytes(self.memory_budget_bytes))

    def validate(self) -> "ProtrainConfig":
        _check_choice("codegen", self.codegen, ("inductor", "eager"))
        _check_choice("optimizer", self.optimizer, tuple(OPTIMIZER_STATES_PER_PARAM))
        _check_choice("verify", self.verify, ("auto", "graph", "inductor"))
        if self.verify == "inductor" and self.codegen != "inductor":
            raise ValueError(f"option 'verify': 'inductor' judges plans by Inductor's allocation plan, but codegen is "
                             f"{self.codegen!r}; use codegen='inductor' or verify='graph'")
        for name in ("keep_node_order", "verbose", "auto_plan", "dry_run"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"option {name!r}: got {getattr(self, name)!r}; accepted: True or False")
        k = self.accumulation_steps
        if not is_count(k, 1):
            raise ValueError(f"option 'accumulation_steps': got {k!r}; accepted: an int >= 1 (micro-batches per "
                             "optimizer step)")
        if self.machine is not None:
            if not isinstance(self.machine, Mapping):
                raise ValueError(f"option 'machine': got {self.machine!r}; accepted: a dict of machine constants")

            CPU.with_overrides(self.machine)  # raises ValueError naming a bad key or value
            object.__setattr__(self, "machine", dict(self.machine))
        return self

    def verify_for(self, device: Any) -> str:
        """The judge ``verify`` names for a step on ``device``: ``"auto"`` resolved (``"inductor"`` on
        a CUDA device with Inductor codegen, else ``"graph"``), the others as given."""
        if self.verify != "auto":
            return self.verify
        on_cuda = device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda"
        return "inductor" if on_cuda and self.codegen == "inductor" else "graph"

    @property
    def optimizer_states_per_param(self) -> int:
        return OPTIMIZER_STATES_PER_PARAM[self.optimizer]


def _check_choice(name: str, value: Any, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(f"option {name!r}: got {value!r}; accepted: {', '.join(map(repr, accepted))}")


#: Option names as users write them in ``options=`` → config field.
_OPTION_FIELDS = {
    "memory_budget": "memory_budget_bytes",
    "codegen": "codegen",
    "optimizer": "optimizer",
    "keep_node_order": "keep_node_order",
    "verbose": "verbose",
    "plan": "plan",
    "machine": "machine",
    "auto_plan": "auto_plan",
    "dry_run": "dry_run",
    "verify": "verify",
    "accumulation_steps": "accumulation_steps",
}


def parse_options(options: Mapping[str, Any] | None) -> ProtrainConfig:
    """Parse the ``options=`` mapping of ``torch.compile`` into a validated :class:`ProtrainConfig`."""
    if options is None:
        return ProtrainConfig()
    if isinstance(options, ProtrainConfig):
        return options.validate()
    if not isinstance(options, Mapping):
        raise ValueError(f"options must be a dict, got {type(options).__name__}")
    kwargs: dict[str, Any] = {}
    for key, value in options.items():
        if key not in _OPTION_FIELDS:
            raise ValueError(
                f"unknown protrain option {key!r}; accepted options: {', '.join(sorted(_OPTION_FIELDS))}"
            )
        if key == "memory_budget" and value is not None:
            value = parse_bytes(value, option="memory_budget")
        if key == "plan" and value is not None:
            value = parse_plan(value)
        kwargs[_OPTION_FIELDS[key]] = value
    return ProtrainConfig(**kwargs).validate()


def config_as_options(config: ProtrainConfig) -> dict[str, Any]:
    """The inverse of :func:`parse_options` (for reports and for re-compiling with the same settings)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {opt: fields[field] for opt, field in _OPTION_FIELDS.items()}
