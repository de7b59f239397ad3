"""The hf engine's prefix cache: the keys/values of prompts' leading tokens outlive their jobs
and are copied into the rows of later jobs whose tokens start the same way.

A prompt is cut into blocks of `block` tokens; each full block is named by a digest of its
tokens chained to its predecessor's (vLLM's hashed blocks), so a block stands for the whole
prefix up to its end. The blocks live in one pool `[layers, heads, blocks x block, head_dim]`
for keys and one for values (a head's tokens in the row's layout, so that a copy goes straight
into a row), bounded by a byte budget and evicted least recently used, the
later blocks of a prefix before its earlier ones. A joining row gets its cached blocks copied
into its columns of the batch's cache (worker/engines/kvcache.py) and feeds only the rest; a
row's blocks go in once it has been prefilled and again when it leaves (a chat's next turn
then finds its earlier turns' answers too). Why copies and not shared blocks: docs/design.md,
"The prefix cache".
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict

import torch

from worker.engines.kvcache import SlotKV

#: The default budget's cap, and its share of the machine's memory.
DEFAULT_CAP = 4 << 30
DEFAULT_SHARE = 0.1


def memory(device: torch.device) -> int:
    """The bytes of memory the device has (the machine's, for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budget(device: torch.device) -> int:
    """Bytes for the cache when none is set: a tenth of the device's memory, at most 4 GiB."""
    return int(min(DEFAULT_CAP, memory(device) * DEFAULT_SHARE))


def digests(tokens: list[int], block: int, have: list[bytes]) -> list[bytes]:
    """The chained digests of `tokens`' full blocks; `have` holds those of a prefix already
    named (extended in place and returned)."""
    prev = have[-1] if have else b""
    for i in range(len(have) * block, len(tokens) - block + 1, block):
        prev = hashlib.blake2b(prev + array("q", tokens[i : i + block]).tobytes(), digest_size=16).digest()
        have.append(prev)
    return have


class PrefixCache:
    def __init__(self, layers, heads, head_dim, dtype: torch.dtype, device, budget: int, block: int = 16):
        self.shape = (layers, heads, block, head_dim)
        self.dtype, self.device, self.block = dtype, torch.device(device), block
        per_block = 2 * layers * heads * block * head_dim * torch.empty((), dtype=dtype).element_size()
        self.capacity = max(0, budget // per_block)
        self.k: torch.Tensor | None = None  # allocated at the first store (torch.empty: untouched pages cost nothing)
        self.v: torch.Tensor | None = None
        self.index: OrderedDict[bytes, int] = OrderedDict()  # digest -> pool block; least recently used first
        self.free = list(range(self.capacity - 1, -1, -1))
        self.queries = self.hits = 0  # prompt tokens looked up and found (vLLM's counters)

    @classmethod
    def for_kv(cls, kv: SlotKV, budget: int, block: int = 16) -> PrefixCache:
        layers, heads, head_dim = kv.shape
        return cls(layers, heads, head_dim, kv.dtype, kv.device, budget, block)

    def match(self, tokens: list[int], names: list[bytes]) -> list[int]:
        """The pool blocks of `tokens`' longest cached prefix, leaving at least one token to feed
        (its logits are the next token's); they become the most recently used."""
        found = []
        for name in names[: self._named(tokens, names)]:
            at = self.index.get(name)
            if at is None:
                break
            found.append(at)
        self._touch(names[: len(found)])
        return found

    def peek(self, tokens: list[int], names: list[bytes]) -> int:
        """How many blocks `match` would find now (nothing is touched)."""
        count = 0
        for name in names[: self._named(tokens, names)]:
            if name not in self.index:
                break
            count += 1
        return count

    def _named(self, tokens: list[int], names: list[bytes]) -> int:
        """The blocks a match may use (not the last token's), named in `names`."""
        limit = (len(tokens) - 1) // self.block
        if len(names) < limit:
            digests(tokens[: limit * self.block], self.block, names)
        return limit

    def fill(self, kv: SlotKV, row: int, col: int, blocks: list[int]) -> None:
        """Copy `blocks` into `row`'s columns from `col` on."""
        layers, heads, _, _ = self.shape
        slots = self._slots(blocks)
        end = col + len(slots)
        for layer in range(layers):
            for pool, buf in ((self.k, kv.k[layer]), (self.v, kv.v[layer])):
                for head in range(heads):
                    torch.index_select(pool[layer, head], 0, slots, out=buf[row, head, col:end])

    def store(self, kv: SlotKV, row: int, tokens: list[int], names: list[bytes]) -> None:
        """Keep the full blocks of `row`'s tokens (`tokens`: what its valid columns hold, in
        order) that the cache lacks, evicting the least recently used blocks for room."""
        if not self.capacity:
            return
        digests(tokens, self.block, names)
        count = min(len(tokens) // self.block, self.capacity)
        start = 0
        while start < count and names[start] in self.index:
            start += 1
        self._touch(names[:start])
        if start == count:
            return
        if self.k is None:
            layers, heads, block, head_dim = self.shape
            size = (layers, heads, self.capacity * block, head_dim)
            self.k = torch.empty(size, dtype=self.dtype, device=self.device)
            self.v = torch.empty(size, dtype=self.dtype, device=self.device)
        ids = []
        for name in names[start:count]:
            at = self.index.pop(name, None)  # a later block may be cached already
            ids.append(at if at is not None else self._take())
            self.index[name] = ids[-1]
        self._touch(names[:count])
        s, e = kv.start, kv.end
        cols = kv.mask[row, s:e].nonzero().view(-1)[start * self.block : count * self.block] + s
        slots = self._slots(ids)
        for layer in range(self.shape[0]):
            for pool, buf in ((self.k, kv.k[layer]), (self.v, kv.v[layer])):
                pool[layer][:, slots] = buf[row][:, cols]

    def _slots(self, blocks: list[int]) -> torch.Tensor:
        """The pool's token slots of `blocks`, in order."""
        b = self.block
        return (torch.tensor(blocks, device=self.device)[:, None] * b + torch.arange(b, device=self.device)).view(-1)

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        _, at = self.index.popitem(last=False)
        return at

    def _touch(self, names: list[bytes]) -> None:
        """Most recently used, the first block last: a prefix's later blocks go first."""
        for name in reversed(names):
            self.index.move_to_end(name)
