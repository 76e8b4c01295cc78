"""The ``protrain`` backend resolves from installed package metadata, with no import of ours."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap

import torch

import protrain_fx.backend


def test_entry_point_is_declared_in_installed_metadata() -> None:
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert "protrain" in eps.names
    (ep,) = [ep for ep in eps if ep.name == "protrain"]
    assert ep.value == "protrain_fx.backend:protrain"
    assert ep.dist is not None and ep.dist.name == "protrain_fx"
    assert ep.load() is protrain_fx.backend.protrain


def test_dynamo_lookup_returns_our_function() -> None:
    from torch._dynamo.backends.registry import lookup_backend

    assert "protrain" in torch._dynamo.list_backends()
    assert lookup_backend("protrain") is protrain_fx.backend.protrain


# Runs in a fresh interpreter started outside the repository, so only the installed metadata can
# lead torch to the backend.
_CHILD = textwrap.dedent(
    """
    import sys
    import torch

    assert "protrain_fx" not in sys.modules, "protrain_fx imported at interpreter start"
    assert "protrain" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
    assert "protrain_fx" not in sys.modules, "list_backends() should not import the backend"

    def f(x, w):
        return torch.tanh(x @ w).pow(2).sum()

    torch.manual_seed(0)
    x = torch.randn(4, 3)
    w = torch.randn(3, 5, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_(True)

    # Plain FX code generation keeps this check fast (Inductor's C++ build is tested elsewhere).
    loss = torch.compile(f, backend="protrain", options={"codegen": "eager"})(x, w)
    loss.backward()
    ref = f(x, w_ref)
    ref.backward()
    assert torch.equal(loss, ref) and torch.equal(w.grad, w_ref.grad)

    # The package was loaded by Dynamo through the entry point, and that is the function it runs.
    assert "protrain_fx.backend" in sys.modules
    from torch._dynamo.backends.registry import lookup_backend
    assert lookup_backend("protrain") is sys.modules["protrain_fx.backend"].protrain

    import protrain_fx
    records = protrain_fx.captured_graphs()
    assert len(records) == 1, records
    assert records[0].backward is not None and records[0].forward is not None
    assert records[0].config.codegen == "eager"
    print("CHILD-OK")
    """
)


def test_backend_resolves_in_fresh_interpreter_without_import(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        cwd=tmp_path,  # not the repository: no accidental import from the working tree
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CHILD-OK" in proc.stdout


# A source tree on sys.path without the package installed: torch finds no entry point for it.
_NO_ENTRY_POINT = textwrap.dedent(
    """
    import importlib.metadata

    real = importlib.metadata.entry_points

    def entry_points(**kwargs):
        if kwargs.get("group") == "torch_dynamo_backends":
            return importlib.metadata.EntryPoints(())
        return real(**kwargs)

    importlib.metadata.entry_points = entry_points
    import torch
    assert "protrain" not in torch._dynamo.list_backends()

    import protrain_fx

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    fit = protrain_fx.what_fits(model, torch.randn(4, 8), memory_budget="64MiB", options={"codegen": "eager"})
    assert fit.fits, fit
    print("CHILD-OK")
    """
)


def test_library_functions_that_compile_resolve_the_backend_without_installed_metadata() -> None:
    """``what_fits`` (and the report and the Trainer integration, the same way) compiles with the name
    ``"protrain"``: it registers the name itself where the package runs from a source tree."""
    proc = subprocess.run([sys.executable, "-c", _NO_ENTRY_POINT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CHILD-OK" in proc.stdout
