"""Activation plans: per block (and optionally per saved tensor), what happens to saved activations.

A :class:`Plan` is the output of the search and the input of the annotate pass (decide → annotate →
rewrite). It is plain data: standard library only, no torch, no FX; it round-trips through JSON and
carries a format version. Block labels are the ones :class:`~protrain_fx.analysis.blocks.BlockInfo`
finds (``"blocks.0"``, ``"transformer.h.3"``, ...), in forward order.

Per-block policies (:data:`BlockPolicy`):

* ``"none"``: the block's saved activations stay in GPU memory until backward uses them;
* ``"checkpoint"``: they are dropped after forward and the block is recomputed in backward;
* ``"swap"``: they are copied to CPU after forward and prefetched back before backward uses them.

Per-tensor overrides (:data:`TensorPolicy`, keyed by a saved tensor's name) are for a later, finer
search: ``"keep"``, ``"recompute"`` or ``"swap"``; an override wins over its block's policy.

The JSON form (what :meth:`Plan.to_json` writes and :func:`parse_plan` reads)::

    {
      "version": 1,
      "blocks": {"blocks.0": "swap", "blocks.1": "checkpoint", "blocks.2": "none"},
      "tensors": {"mm_3": "recompute"}
    }

``blocks`` keeps forward order; ``tensors`` is written sorted by name. ``tensors`` may be left out
(no overrides); so may ``version`` when a plan is written by hand (it then means the current
:data:`PLAN_VERSION`).
"""

from __future__ import annotations

import difflib
import json
import os
import types
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

#: Version of the plan format; :meth:`Plan.from_dict` refuses any other.
PLAN_VERSION = 1

BlockPolicy = Literal["none", "checkpoint", "swap"]
TensorPolicy = Literal["keep", "recompute", "swap"]

BLOCK_POLICIES: tuple[str, ...] = get_args(BlockPolicy)
TENSOR_POLICIES: tuple[str, ...] = get_args(TensorPolicy)

#: Top-level keys of a plan's dict / JSON form, in the order :meth:`Plan.to_dict` writes them.
_KEYS = ("version", "blocks", "tensors")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """An activation plan: block label → :data:`BlockPolicy`, plus optional per-tensor overrides.

    Attributes:
        blocks: block label → policy, in the order given (forward order by convention). Blocks not
            listed are ``"none"``. Stored as a read-only mapping.
        tensors: saved tensor name → :data:`TensorPolicy`; each overrides its block's policy for that
            one tensor. Stored as a read-only mapping.
        version: the plan format version; only :data:`PLAN_VERSION` is accepted.

    Construction checks the plan's own content (policy values, label types, version) and raises
    ``ValueError`` naming the bad item; :meth:`validate` checks it against a model's blocks and
    tensors. Two plans are equal when they map the same labels to the same policies, whatever the
    order they were listed in.
    """

    blocks: Mapping[str, BlockPolicy]
    tensors: Mapping[str, TensorPolicy] = field(default_factory=dict)
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        _check_version(self.version)
        blocks = _checked_mapping("blocks", self.blocks, "block", BLOCK_POLICIES)
        tensors = _checked_mapping("tensors", self.tensors, "tensor", TENSOR_POLICIES)
        object.__setattr__(self, "blocks", types.MappingProxyType(blocks))
        object.__setattr__(self, "tensors", types.MappingProxyType(tensors))

    # ------------------------------------------------------------------ queries

    def policy(self, label: str) -> BlockPolicy:
        """The policy of block ``label``: ``"none"`` when the plan does not list it."""
        return self.blocks.get(label, "none")

    def rewrites(self) -> bool:
        """Whether the plan swaps or checkpoints a block (one that does neither runs the step as is)."""
        return bool(self.blocks_with("swap") or self.blocks_with("checkpoint"))

    def blocks_with(self, policy: BlockPolicy) -> tuple[str, ...]:
        """The listed blocks whose policy is ``policy``, in the plan's order.

        For ``"none"`` this names only blocks listed as ``"none"``, not the unlisted ones (the plan
        does not know the model's blocks; :func:`interleaved` lists every block).
        """
        if policy not in BLOCK_POLICIES:
            raise ValueError(f"plan: unknown block policy {policy!r}; accepted: {_choices(BLOCK_POLICIES)}")
        return tuple(label for label, p in self.blocks.items() if p == policy)

    def validate(self, labels: Sequence[str], tensor_names: Collection[str] | None = None) -> Plan:
        """Check the plan against a model: every listed block is one of ``labels`` and, when
        ``tensor_names`` is given, every override names one of them. Returns ``self``.

        Raises ``ValueError`` naming every unknown block (and the model's blocks) or unknown tensor.
        Overrides are not checked when ``tensor_names`` is ``None``.
        """
        known = list(labels)
        known_set = set(known)
        unknown = [label for label in self.blocks if label not in known_set]
        if unknown:
            have = f"the model's blocks are {_abbreviated(known)}" if known else "the model has no repeated blocks"
            raise ValueError(
                f"plan: unknown block{'s' if len(unknown) > 1 else ''} {_choices(unknown)}"
                f"{_suggestion(unknown[0], known)}; {have}"
            )
        if tensor_names is not None:
            names = set(tensor_names)
            unknown = [name for name in self.tensors if name not in names]
            if unknown:
                raise ValueError(
                    f"plan: override{'s' if len(unknown) > 1 else ''} for unknown saved "
                    f"tensor{'s' if len(unknown) > 1 else ''} {_choices(unknown)}"
                    f"{_suggestion(unknown[0], names)}; the model saves {len(names)} tensors"
                )
        return self

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain dict form: ``version``, ``blocks`` (plan order), ``tensors`` (sorted by name)."""
        return {
            "version": self.version,
            "blocks": dict(self.blocks),
            "tensors": dict(sorted(self.tensors.items())),
        }

    def to_json(self) -> str:
        """Stable JSON text (no trailing newline): equal plans listed in the same order give equal text."""
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        """A plan from its dict form. Raises ``ValueError`` for an unknown or missing key, a version
        other than :data:`PLAN_VERSION`, or a bad policy value, naming it and what is accepted."""
        if not isinstance(d, Mapping):
            raise ValueError(f"plan: expected a mapping with keys {_choices(_KEYS)}, got {type(d).__name__}")
        extra = [k for k in d if k not in _KEYS]
        if extra:
            raise ValueError(
                f"plan: unknown key{'s' if len(extra) > 1 else ''} {_choices(extra)}; accepted keys: {_choices(_KEYS)}"
            )
        if "blocks" not in d:
            raise ValueError(f"plan: missing key 'blocks' (block label → one of {_choices(BLOCK_POLICIES)})")
        return cls(blocks=d["blocks"], tensors=d.get("tensors", {}), version=d.get("version", PLAN_VERSION))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """A plan from :meth:`to_json` text (or any JSON object of the same form); ``ValueError``
        for text that is not JSON, a repeated key, or anything :meth:`from_dict` refuses."""
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError as e:
            raise ValueError(f"plan: not valid JSON ({e})") from None
        return cls.from_dict(data)

    # ------------------------------------------------------------------ display

    def table(self, labels: Sequence[str] | None = None) -> str:
        """A printable table: one row per block (``labels`` in order when given, the plan's own
        blocks otherwise), then the per-tensor overrides. Listed blocks missing from ``labels`` are
        shown last, marked ``not in model``."""
        if labels is None:
            rows = list(self.blocks.items())
            strays: list[tuple[str, str]] = []
        else:
            known = set(labels)
            rows = [(label, self.policy(label)) for label in labels]
            strays = [(label, p) for label, p in self.blocks.items() if label not in known]
        summary = ", ".join(f"{sum(1 for _, r in rows if r == p)} {p}" for p in ("swap", "checkpoint", "none"))
        lines = [f"activation plan v{self.version}: {len(rows)} blocks ({summary})"]
        lines += _format_rows(("block", "policy"), rows + [(label, f"{p}  (not in model)") for label, p in strays])
        if self.tensors:
            lines.append(f"per-tensor overrides ({len(self.tensors)}):")
            lines += _format_rows(("tensor", "policy"), sorted(self.tensors.items()))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"Plan(blocks={dict(self.blocks)!r}, tensors={dict(self.tensors)!r}, version={self.version!r})"

    def __hash__(self) -> int:  # order-insensitive, like __eq__
        return hash((frozenset(self.blocks.items()), frozenset(self.tensors.items()), self.version))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # mappingproxy does not pickle; plain dicts do
        return (_rebuild, (dict(self.blocks), dict(self.tensors), self.version))


def _rebuild(blocks: dict[str, str], tensors: dict[str, str], version: int) -> Plan:
    return Plan(blocks=blocks, tensors=tensors, version=version)


def interleaved(labels: Sequence[str], n_swap: int, n_checkpoint: int) -> Plan:
    """ProTrain's layout: the first ``n_swap`` blocks swap, the checkpoint blocks are spread evenly
    over the rest, with the "none" blocks toward the end. Every label is listed in the plan.

    The first blocks swap because they have the most forward compute after them to hide the copy
    out, and are reached last in backward, which leaves the most time to prefetch them back.

    "Spread" precisely: let ``R = len(labels) - n_swap`` and ``C = n_checkpoint``. When ``C > 0``,
    the ``R`` remaining blocks are cut into ``C`` consecutive segments whose lengths are
    ``q = R // C`` or ``q + 1``, the ``C - R % C`` short ones first; each segment is one checkpoint
    block followed by ``"none"`` blocks. So, among the remaining blocks:

    * the first is a checkpoint block;
    * the gaps between consecutive checkpoint blocks (differences of their positions) are ``q`` or
      ``q + 1`` (they differ by at most one) and never decrease;
    * the last checkpoint block is followed by ``q`` or ``q + 1`` "none" blocks, the longest run,
      so the last block (the first one backward reaches and frees) is "none" whenever ``C < R``.

    With ``C == 0`` every remaining block is "none"; with ``C == R`` all are checkpoint.

    Raises ``ValueError`` for a negative or non-integer count, ``n_swap + n_checkpoint`` above
    ``len(labels)``, or a repeated label.
    """
    labels = list(labels)
    for name, n in (("n_swap", n_swap), ("n_checkpoint", n_checkpoint)):
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"interleaved: {name} must be an int, got {n!r} ({type(n).__name__})")
        if n < 0:
            raise ValueError(f"interleaved: {name} must be 0 or more, got {n}")
    if n_swap + n_checkpoint > len(labels):
        raise ValueError(
            f"interleaved: n_swap ({n_swap}) + n_checkpoint ({n_checkpoint}) = {n_swap + n_checkpoint} "
            f"exceeds the {len(labels)} blocks"
        )
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"interleaved: repeated block label{'s' if len(repeated) > 1 else ''} {_choices(repeated)}")

    rest = len(labels) - n_swap
    checkpointed = set(_segment_starts(rest, n_checkpoint))
    blocks: dict[str, BlockPolicy] = {}
    for i, label in enumerate(labels):
        if i < n_swap:
            blocks[label] = "swap"
        elif i - n_swap in checkpointed:
            blocks[label] = "checkpoint"
        else:
            blocks[label] = "none"
    return Plan(blocks=blocks)


def parse_counts(spec: str) -> tuple[int | None, int | None]:
    """``"swap=2,checkpoint=10"`` → ``(2, 10)``, the counts of :func:`interleaved`; ``all`` stands
    for every block the other count leaves (``"checkpoint=all"`` → ``(0, None)``), a missing count
    is 0. Raises ``ValueError`` naming what is wrong."""
    counts: dict[str, int | None] = {"swap": 0, "checkpoint": 0}
    seen = set()
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in counts or key in seen:
            raise ValueError(f"plan spec {spec!r}: expected swap=N,checkpoint=M (N, M counts or 'all') or a .json path")
        seen.add(key)
        if value == "all":
            counts[key] = None
        elif value.isdigit():
            counts[key] = int(value)
        else:
            raise ValueError(f"plan spec {spec!r}: {key} must be a count or 'all', got {value!r}")
    if counts["swap"] is None and counts["checkpoint"] is None:
        raise ValueError(f"plan spec {spec!r}: only one of swap and checkpoint can be 'all'")
    return counts["swap"], counts["checkpoint"]


def from_counts(spec: str, labels: Sequence[str]) -> Plan:
    """The interleaved plan a :func:`parse_counts` spec means for blocks ``labels``."""
    n_swap, n_checkpoint = parse_counts(spec)
    if n_swap is None:
        n_swap = max(0, len(labels) - n_checkpoint)
    if n_checkpoint is None:
        n_checkpoint = max(0, len(labels) - n_swap)
    return interleaved(labels, n_swap, n_checkpoint)


def _segment_starts(n: int, k: int) -> list[int]:
    """Starts of ``k`` consecutive segments covering ``range(n)``, lengths ``n // k`` or one more,
    the short ones first (``[]`` for ``k == 0``)."""
    if k == 0:
        return []
    q, r = divmod(n, k)
    n_short = k - r
    return [i * q + max(0, i - n_short) for i in range(k)]


def parse_plan(value: Any, *, option: str = "plan") -> Plan:
    """A :class:`Plan` from what a user may pass as ``options={"plan": ...}``: a ``Plan``, a dict in
    the JSON form, JSON text, or the path (``str`` or ``os.PathLike``) of a ``.json`` file holding
    it. Raises ``ValueError`` prefixed with the option name (and the file, when read from one)."""
    accepted = "a Plan, a dict such as {'blocks': {'blocks.0': 'checkpoint'}}, JSON text, or the path of a .json file"
    if isinstance(value, Plan):
        return value
    try:
        if isinstance(value, Mapping):
            return Plan.from_dict(value)
        if isinstance(value, str) and value.lstrip().startswith("{"):
            return Plan.from_json(value)
    except ValueError as e:
        raise ValueError(f"option {option!r}: {e}") from None
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if not str(path).endswith(".json"):
            raise ValueError(
                f"option {option!r}: {value!r} is neither JSON text nor a .json path; accepted: {accepted}"
            )
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"option {option!r}: cannot read plan file {path!r} ({e.strerror or e})") from None
        try:
            return Plan.from_json(text)
        except ValueError as e:
            raise ValueError(f"option {option!r} (file {path!r}): {e}") from None
    raise ValueError(f"option {option!r}: got {value!r} ({type(value).__name__}); accepted: {accepted}")


# ---------------------------------------------------------------------- helpers


def _check_version(version: Any) -> None:
    if isinstance(version, bool) or version != PLAN_VERSION or not isinstance(version, int):
        raise ValueError(f"plan: version {version!r} is not supported; accepted: {PLAN_VERSION}")


def _checked_mapping(key: str, value: Any, what: str, accepted: tuple[str, ...]) -> dict[str, str]:
    """A plain-dict copy of ``value`` (order kept) after checking its labels and policy values."""
    if not isinstance(value, Mapping):
        raise ValueError(
            f"plan: {key!r} must be a mapping of {what} name → one of {_choices(accepted)}, "
            f"got {type(value).__name__}"
        )
    out: dict[str, str] = {}
    for name, policy in value.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"plan: {key!r}: {what} names must be non-empty strings, got {name!r}")
        if policy not in accepted or not isinstance(policy, str):
            raise ValueError(f"plan: {what} {name!r} has policy {policy!r}; accepted: {_choices(accepted)}")
        out[name] = policy
    return out


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"plan: key {k!r} appears more than once")
        out[k] = v
    return out


def _choices(items: Sequence[Any]) -> str:
    return ", ".join(repr(x) for x in items)


def _abbreviated(labels: Sequence[str], head: int = 6, tail: int = 2) -> str:
    if len(labels) <= head + tail + 1:
        return _choices(labels)
    return f"{_choices(labels[:head])}, ..., {_choices(labels[-tail:])} ({len(labels)} blocks)"


def _suggestion(name: str, known: Collection[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _format_rows(header: tuple[str, str], rows: Sequence[tuple[str, str]]) -> list[str]:
    width = max([len(header[0])] + [len(r[0]) for r in rows])
    lines = [f"  {header[0]:<{width}}  {header[1]}", f"  {'-' * width}  {'-' * max(len(header[1]), 10)}"]
    lines += [f"  {a:<{width}}  {b}" for a, b in rows]
    return lines
