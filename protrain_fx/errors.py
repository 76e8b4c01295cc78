"""Errors a user acts on, and how they reach the user through Dynamo as themselves.

The backend runs inside Dynamo's compile of the user's first call. Dynamo wraps any exception a
backend raises in ``torch._dynamo.exc.BackendCompilerFailed`` and appends a footer asking for a bug
report to PyTorch, so ``except NoPlanFits`` or ``except ValueError`` around a training step would
catch nothing. Dynamo lets through unchanged only exceptions that are ``ShortenTraceback``s (its
own marker for "the backend's message is the useful part"). :func:`surfaced` gives an error of ours
that marker: a subclass of the error's own class and of ``ShortenTraceback``, so it is still caught
as itself, as a ``ValueError`` (where it is one), and prints its own message without the footer,
under a traceback from the user's call straight to the backend (Dynamo's frames between left out).

Which errors are the user's to act on (:func:`is_user_error`): bad settings (``ValueError``, of
which :class:`~protrain_fx.search.search.NoPlanFits` is one), wrong types (``TypeError``), a host too small
for the chunk store (``MemoryError``), and :class:`UnsupportedError` for what this release refuses
with a way out. Anything else (an ``AssertionError``, an error inside PyTorch) keeps Dynamo's
wrapping: it is a bug, and the report PyTorch asks for is the right next step.
"""

from __future__ import annotations

from typing import Any


class UnsupportedError(RuntimeError):
    """What this release refuses, with the way out in the message (a graph that reads an offloaded
    model before its chunks are placed, gradients landing twice in one step, ...)."""


class TooFewBuffers(ValueError):
    """A rewritten step holds more parameter chunks at once than the offload has device buffers
    (``passes/gather.py``). ``needed``: the chunks it holds at its most. With counts by hand the
    user raises ``n_buffer``; with counts the backend chooses, the planner places the chunks again
    with ``needed`` buffers (the cost model counts a block's chunks, the rewrite what the graph's
    order keeps live: a checkpointed block recomputed while the next one's backward still reads
    its chunks)."""

    def __init__(self, message: str, needed: int) -> None:
        super().__init__(message)
        self.needed = needed


def too_few_buffers(error: BaseException | None) -> TooFewBuffers | None:
    """The :class:`TooFewBuffers` that ``error`` is or was raised from (the pass runner wraps a
    pass's ``ValueError`` in one naming the pass), else ``None``."""
    while error is not None:
        if isinstance(error, TooFewBuffers):
            return error
        error = error.__cause__
    return None


def is_user_error(error: BaseException) -> bool:
    """Whether ``error`` is one the user acts on (module docstring), not a bug of ours or PyTorch's."""
    return isinstance(error, (ValueError, TypeError, MemoryError, UnsupportedError))


_SURFACED: dict[type, type] = {}


def surfaced(error: BaseException, first_useful_frame: Any = None) -> BaseException:
    """``error`` as an instance of a subclass of its class that Dynamo raises unwrapped (module
    docstring); the same object when it is not a user error or already surfaced.
    ``first_useful_frame``: the backend's own frame, where Dynamo cuts the traceback it shows (its own
    frames between the user's call and the backend go; ``TORCHDYNAMO_VERBOSE=1`` keeps them)."""
    from torch._dynamo.exc import ShortenTraceback

    if not is_user_error(error) or isinstance(error, ShortenTraceback):
        return error
    cls = type(error)
    sub = _SURFACED.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls, ShortenTraceback), {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__str__": _own_message,
            "__reduce__": _reduce_to_original,
        })
        _SURFACED[cls] = sub
    out = sub.__new__(sub, *error.args)
    out.__dict__.update(error.__dict__)
    out.args = error.args
    out.first_useful_frame = first_useful_frame  # ShortenTraceback's: None keeps every frame
    out._protrain_message = str(error)
    out.__cause__, out.__context__ = error.__cause__, error.__context__
    out.__traceback__ = error.__traceback__
    return out


def _own_message(self: BaseException) -> str:
    """The message as raised: Dynamo appends its bug-report footer to ``args`` on the way out."""
    return self.__dict__.get("_protrain_message") or Exception.__str__(self)


def _reduce_to_original(self: BaseException) -> tuple[Any, ...]:
    """Pickles (multiprocessing, logging to files) as the original class."""
    original = next(c for c in type(self).__mro__[1:] if c in _SURFACED)
    return (_rebuild, (original, self.args, {k: v for k, v in self.__dict__.items()
                                             if k not in ("_protrain_message", "first_useful_frame")}))


def _rebuild(cls: type, args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error
