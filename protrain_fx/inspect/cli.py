"""Command line: ``protrain-fx inspect MODULE:FACTORY`` (or ``python -m protrain_fx inspect ...``).

FACTORY is a callable returning ``(model, example_inputs)``; ``--kw key=value`` arguments are passed
to it (values parsed as Python literals when possible). Prints the per-block table and, with
``--graphs``, the readable forward and backward graphs; ``--timeline DIR`` writes the predicted
timeline (snapshot pickle, Chrome trace, SVG).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from typing import Any, Sequence

from protrain_fx.inspect.report import inspect_model


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _pairs(items: Sequence[str], what: str) -> dict[str, Any]:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"protrain-fx: {what} expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key] = _literal(value)
    return out


def _load(spec: str):
    if ":" not in spec:
        raise SystemExit(f"protrain-fx: expected MODULE:FACTORY, got {spec!r}")
    module_name, attr = spec.split(":", 1)
    sys.path.insert(0, "")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"protrain-fx: cannot load {spec!r}: {e}") from e


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="protrain-fx", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="capture one training step and print its per-block table")
    ins.add_argument("factory", help="MODULE:FACTORY returning (model, example_inputs), e.g. examples.gpt:example")
    ins.add_argument("--kw", action="append", default=[], help="key=value passed to the factory")
    ins.add_argument("--option", action="append", default=[], help="key=value backend option (e.g. codegen=eager)")
    ins.add_argument("--graphs", action="store_true", help="print the readable forward and backward graphs")
    ins.add_argument("--time", action="store_true", help="measure the time share of each block")
    ins.add_argument("--chunks", action="store_true", help="print the parameter chunk layout")
    ins.add_argument("--timeline", metavar="DIR", help="write the predicted timeline files into DIR")
    args = parser.parse_args(argv)


    model, inputs = _load(args.factory)(**_pairs(args.kw, "--kw"))
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    report = inspect_model(model, *inputs, options=_pairs(args.option, "--option"), measure_time=args.time)
    print(report.summary())
    if args.chunks:
        print("\n" + report.chunk_layout().table())
    if args.graphs:
        for g in report.graphs:
            for kind in ("forward", "backward"):
                if kind in g.readable:
                    print(f"\n{g.readable[kind]}")
    if args.timeline:
        for kind, path in report.write_timelines(args.timeline).items():
            print(f"wrote {kind}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
