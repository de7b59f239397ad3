"""The model's linear layers through oneDNN with weights packed once, at load.

PyTorch's `nn.Linear` on a CPU is slow and erratic for the shapes a decode step has (a few
rows against a large weight); oneDNN with the weight reordered once into its blocked layout
(what torch.compile's CPU "freezing" and vLLM's CPU backend do) is faster there
(docs/benchmarks.md, "hf engine: packed linear layers"). `pack(model)` replaces every
`nn.Linear` by a `PackedLinear`; results agree with `nn.Linear`'s to float rounding, not bit for
bit. `GENQ_PACKED_LINEARS=false` keeps PyTorch's own. More: docs/design.md, "Packed linear
layers".
"""

from __future__ import annotations

import torch

# The row count oneDNN packs the weights for. Any count works with the packed weight; this one
# measured best for the output projection across 1-64 rows, against no hint, 1 and 32 (a
# one-off measurement of that layer alone, 2026-12-01, not part of a benchmark).
PACK_ROWS = 64


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
    with torch.no_grad():
        for i, (parent, name, child) in enumerate(found):
            if i == 0:  # can oneDNN pack this dtype on this CPU, and does it compute the same?
                try:
                    linear = PackedLinear(child, rows)
                    x = torch.randn(3, child.in_features, dtype=child.weight.dtype)
                    same = torch.allclose(linear(x).float(), child(x).float(), rtol=1e-2, atol=1e-2)
                except RuntimeError as exc:  # "bf16 path needs the cpu support avx_ne_convert or ..."
                    return f"PyTorch's (oneDNN cannot pack them here: {exc})"
                if not same:
                    return "PyTorch's (oneDNN's packed product differed from PyTorch's here)"
            else:
                linear = PackedLinear(child, rows)
            setattr(parent, name, linear)  # one at a time: the unpacked weight goes at once
    return f"{len(found)} packed for oneDNN"
