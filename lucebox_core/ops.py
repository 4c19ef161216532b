"""Named ops: the one way a backend offers a faster kernel for an op, whether the op is generic or a family's.

Model code calls ops by name on the object it was built with (`ops.rms_norm(...)`,
`ops.moe_route(...)`, a family's own). Every op has a *reference*, written in plain torch for clarity:

- the generic ops (matmul on GGUF blocks, norms, RoPE, attention, ...) are the methods of the core's
  `TorchBackend`, which every backend extends;
- a family's own ops (a recurrent mixer's scan, a convolution, MoE routing...) are functions in the family's
  plugin, collected in an `OpSet` and bound to a backend with `OpSet.bind(backend)`.

A backend offers a kernel for any op, by name, through the `lucebox_op_kernels` hook (`OpKernel` records):
`kernel(ops, *args, **kwargs)` computes the op and `accepts(ops, *args, **kwargs)` says whether it can take
these arguments (device, dtypes, shapes). A call tries the backend's kernels for the op, highest priority
first, and runs the reference where none accepts. An op with no kernel stays the plain reference, at no
cost. The references themselves call other ops through the same object, so a composite op that has no
kernel still runs the kernels of its parts.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import attrs

from .errors import PluginError


@attrs.frozen
class ResolvedKernel:
    """An `OpKernel` with its functions imported."""

    name: str  # "backend.op", for messages
    kernel: Callable[..., Any]
    accepts: Callable[..., bool] | None


class Op:
    """One named op as one backend runs it: each kernel whose check accepts the arguments, else the reference.

    `owner` is what kernels receive as their first argument: the backend for a generic op, the family's
    bound view of it (`BoundOps`) for a family op.
    """

    __slots__ = ("name", "kernels", "reference", "owner")

    def __init__(self, name: str, kernels: list[ResolvedKernel], reference: Callable[..., Any], owner: Any):
        self.name = name
        self.kernels = tuple(kernels)
        self.reference = reference
        self.owner = owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Called for every op of a forward pass (a thousand at 27B): kept to the bare loop.
        owner = self.owner
        for candidate in self.kernels:
            accepts = candidate.accepts
            if accepts is None or accepts(owner, *args, **kwargs):
                return candidate.kernel(owner, *args, **kwargs)
        return self.reference(*args, **kwargs)

    def choice(self, *args: Any, **kwargs: Any) -> str:
        """Which implementation a call with these arguments runs: a kernel's name, or "reference"."""
        for candidate in self.kernels:
            if candidate.accepts is None or candidate.accepts(self.owner, *args, **kwargs):
                return candidate.name
        return "reference"

    def __repr__(self) -> str:
        names = ", ".join(k.name for k in self.kernels)
        return f"<op {self.name}: {names}, else the reference>"


def kernel_table(backend_name: str, specs: list[Any] | None = None) -> dict[str, list[ResolvedKernel]]:
    """Op name -> the kernels offered for backend `backend_name`, highest priority first, imported now.

    `specs`: `OpKernel` records (default: every one the installed plugins register). A kernel whose module
    does not import is left out with a warning naming it."""
    from .specs import resolve

    if specs is None:
        from .plugins import registry

        specs = registry().op_kernels()
    table: dict[str, list[tuple[int, ResolvedKernel]]] = {}
    for spec in specs:
        if spec.backend != backend_name:
            continue
        try:
            resolved = ResolvedKernel(spec.name, resolve(spec.kernel),
                                      resolve(spec.accepts) if spec.accepts is not None else None)
        except (ImportError, AttributeError) as exc:
            # One broken plugin must not take the backend down: the op keeps its other kernels, or the
            # reference, and the warning says which kernel is lost (it would otherwise only look slow).
            warnings.warn(f"kernel {spec.name} is left out: cannot import {spec.kernel!r}: {exc}", RuntimeWarning,
                          stacklevel=2)
            continue
        table.setdefault(spec.op, []).append((spec.priority, resolved))
    return {op: [k for _, k in sorted(entries, key=lambda e: -e[0])] for op, entries in table.items()}


def install_kernels(backend: Any, table: dict[str, list[ResolvedKernel]]) -> None:
    """Route `backend`'s generic ops that have kernels through them (an `Op` per op, set on the instance, so
    that the references' own calls to other ops are routed too). Kernels for ops the backend does not
    define are a family's: `OpSet.bind` picks them up from `backend.op_kernels`."""
    backend.op_kernels = table
    for name, kernels in table.items():
        reference = getattr(backend, name, None)
        if callable(reference):
            setattr(backend, name, Op(name, kernels, reference, backend))


class OpSet:
    """A family's own ops: name -> reference function `reference(ops, *args, **kwargs)`, where `ops` is the
    backend as the family sees it (`BoundOps`: generic ops, services, and these ops)."""

    def __init__(self, family: str):
        self.family = family
        self.references: dict[str, Callable[..., Any]] = {}

    def reference(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: register `function` as the reference of the op named like it."""
        name = function.__name__
        if name in self.references:
            raise ValueError(f"{self.family}: op {name!r} is defined twice")
        self.references[name] = function
        return function

    def bind(self, backend: Any) -> BoundOps:
        """`backend` with these ops on it, each routed to the backend's kernels for it."""
        return BoundOps(backend, self)


class BoundOps:
    """A backend as one family's model sees it: its generic ops and services (read through, unchanged) plus
    the family's named ops, each an `Op` over the kernels the backend offers for it, else the reference."""

    def __init__(self, backend: Any, opset: OpSet):
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "opset", opset)
        # The backend's ops and its device, held here too: read a thousand times a forward pass, they should
        # not go through `__getattr__` each time. Everything else reads through.
        for name in dir(type(backend)):
            if not name.startswith("_") and callable(getattr(type(backend), name, None)):
                object.__setattr__(self, name, getattr(backend, name))
        for name in ("device", "dtype"):
            if hasattr(backend, name):
                object.__setattr__(self, name, getattr(backend, name))
        table = getattr(backend, "op_kernels", {}) or {}
        for name, reference in opset.references.items():
            if hasattr(type(backend), name):
                raise PluginError(f"{opset.family}: op {name!r} would hide the backend's own op of that name")
            bound = functools.partial(reference, self)
            kernels = table.get(name)
            object.__setattr__(self, name, Op(name, kernels, bound, self) if kernels else bound)

    def __getattr__(self, name: str) -> Any:  # only called for what this object does not hold itself
        return getattr(object.__getattribute__(self, "backend"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"set {name!r} on the backend itself ({self.backend!r}), not on a family's view of it")

    def __repr__(self) -> str:
        return f"{self.backend!r} with the {self.opset.family} ops"


def with_family_ops(backend: Any) -> BoundOps:
    """`backend` with the named ops of every installed family bound (`ModelFamily.ops`): where a kernel's
    check against its op's reference needs the reference of a family op by name."""
    from .plugins import registry
    from .specs import resolve

    merged = OpSet("installed families")
    for family in registry().model_families():
        if family.ops is not None:
            for name, reference in resolve(family.ops).references.items():
                merged.references.setdefault(name, reference)
    return merged.bind(backend)
