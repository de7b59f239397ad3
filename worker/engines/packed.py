"""The model's linear layers through oneDNN with weights packed once, at load.

PyTorch's `nn.Linear` on a CPU is slow and erratic for the shapes a decode step has (a few
rows against a large weight); oneDNN with the weight reordered once into its blocked layout
(what torch.compile's CPU "freezing" and vLLM's CPU backend do) is faster there
(docs/benchmarks.md, "hf engine: packed linear layers"). `pack(model)` replaces every
`nn.Linear` by a `PackedLinear`; results agree with `nn.Linear`'s to float rounding, not bit for
bit. Sibling projections of one input (a layer's query/key/value, an MLP's gate/up) are packed
as one weight and run as one product (`Fused`), as vLLM's merged linear layers do: fewer, wider
calls, where a decode step's small products cost mostly their fixed overhead.
`GENQ_PACKED_LINEARS=false` keeps PyTorch's own. More: docs/design.md, "Packed linear layers".
"""

from __future__ import annotations

import torch

# The row count oneDNN packs the weights for. Any count works with the packed weight; this one
# measured best for the output projection across 1-64 rows, against no hint, 1 and 32 (a
# one-off measurement of that layer alone, 2026-12-01, not part of a benchmark).
PACK_ROWS = 64

#: Sibling linears (children of one module) that the models call on the same input, one after
#: the other: packed and run together (`Fused`).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class PackedLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, rows: int = PACK_ROWS):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed"


class Fused:
    """One packed product for sibling linears that take the same input: the first member
    called computes every member's output; the others, called with the same tensor, take
    theirs. A member called with another input computes the product for it (correct, only
    slower): nothing depends on the order or the pattern of the model's calls."""

    def __init__(self, linears: list[torch.nn.Linear], rows: int = PACK_ROWS):
        weight = torch.cat([lin.weight.detach() for lin in linears])
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        biases = [lin.bias for lin in linears]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.sizes = [lin.out_features for lin in linears]
        self._x: torch.Tensor | None = None
        self._outs: tuple[torch.Tensor, ...] = ()

    def output(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if x is not self._x:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            self._x, self._outs = x, y.split(self.sizes, dim=-1)
        out = self._outs[i]
        if i == len(self.sizes) - 1:  # the last member: let the input and outputs go
            self._x, self._outs = None, ()
        return out


class FusedMember(torch.nn.Module):
    """One of a `Fused` group's linears, where the model calls it."""

    def __init__(self, group: Fused, index: int, linear: torch.nn.Linear):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed with its siblings"


def _groups(parent: torch.nn.Module) -> list[list[str]]:
    """The `SIBLINGS` groups `parent` has whole: plain linears of one input size, all with a
    bias or all without (`pack` leaves a group one of whose weights another module shares)."""
    children = dict(parent.named_children())
    out = []
    for names in SIBLINGS:
        lins = [children.get(n) for n in names]
        if not all(type(lin) is torch.nn.Linear for lin in lins):
            continue
        if len({lin.in_features for lin in lins}) == 1 and len({lin.bias is None for lin in lins}) == 1:
            out.append(list(names))
    return out


def pack(model: torch.nn.Module, rows: int = PACK_ROWS) -> str:
    """Replace every `nn.Linear` in `model` by a `PackedLinear`, all or none; says what it did
    (for the worker's log). Where oneDNN cannot pack the weights' dtype on this CPU (bfloat16
    without AVX-512), the model keeps PyTorch's linears. Call it on the thread that will run
    the model: a second thread that runs a parallel op slows every op (GNU OpenMP's
    throttling; HFEngine._start)."""
    if not torch.backends.mkldnn.is_available():
        return "PyTorch's (this PyTorch has no oneDNN)"
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]
    if not found:
        return "0 packed for oneDNN (no linear layers)"
    child = found[0][2]  # can oneDNN pack this dtype on this CPU, and does it compute the same?
    try:
        x = torch.randn(3, child.in_features, dtype=child.weight.dtype)
        with torch.no_grad():
            same = torch.allclose(PackedLinear(child, rows)(x).float(), child(x).float(), rtol=1e-2, atol=1e-2)
    except RuntimeError as exc:  # "bf16 path needs the cpu support avx_ne_convert or ..."
        return f"PyTorch's (oneDNN cannot pack them here: {exc})"
    if not same:
        return "PyTorch's (oneDNN's packed product differed from PyTorch's here)"
    tied = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Linear) for p in m.parameters(False)}
    fused = 0
    with torch.no_grad():
        for parent, name, _ in found:
            if type(getattr(parent, name)) is not torch.nn.Linear:
                continue  # packed already, with its siblings
            group = next((g for g in _groups(parent) if name in g), None)
            if group and not any(id(getattr(parent, n).weight) in tied for n in group):
                lins = [getattr(parent, n) for n in group]
                shared = Fused(lins, rows)
                for j, (n, lin) in enumerate(zip(group, lins)):
                    setattr(parent, n, FusedMember(shared, j, lin))  # the unpacked weights go at once
                fused += len(group)
            else:
                setattr(parent, name, PackedLinear(getattr(parent, name), rows))
    return f"{len(found)} packed for oneDNN, {fused} of them with their siblings"
