"""The hf engine's model runner: the forwards, the sampling and the KV cache's rows.

`step` runs one forward for the whole batch: each running row's newest token (or only the
first rows': the others sit the step out) and the arriving jobs' prompts, flattened into one
sequence with each token's own position; their keys/values go straight into the batch's cache
(worker/engines/kvcache.py), so a job that arrives costs no forward of its own. It chooses each
row's next token on the CPU, through the batch's logits processors where a row asks for them
(worker/engines/logits.py), with the log-probabilities of the rows that want them. Its per-row
state (the next tokens, the processors), like the KV cache's rows, follows the batch's rows
(`move`, `swap`), whose order worker/engines/rows.py owns.
"""

from __future__ import annotations

import time

import torch

from worker.engines.kvcache import SlotKV
from worker.engines.logits import RowProcessors
from worker.engines.prefix import PrefixCache
from worker.engines.sampling import LOGPROB_FLOOR, logprobs, sample
from worker.engines.scheduler import Seq

# The fewest tokens that all running rows must share for their attention to read them once
# (`SlotKV.begin`'s `shared`: cascade attention); below it the plain path costs no more.
CASCADE_MIN_TOKENS = 256

Step = tuple[list[int], dict]  # each row's token, and {row: (logprob, top)} for the rows that want them


class ModelRunner:
    def __init__(
        self, lm, kv: SlotKV, device: torch.device, eos: int | None, tok=None, prefix: PrefixCache | None = None
    ):
        self.lm, self.kv, self.device, self.eos, self.tok = lm, kv, device, eos, tok
        self.prefix = prefix if prefix is not None and prefix.capacity else None
        self.scratch: SlotKV | None = None  # the row of a prompt's chunk (`_chunk`)
        self.chunk_s = 0.0  # seconds the last step's chunks took
        self.block = prefix.block if prefix is not None else 0
        # The logits' width (the output layer's; it may exceed the tokenizer's vocabulary).
        head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
        self.vocab = head.weight.shape[0] if head is not None else lm.config.vocab_size
        self.next: torch.Tensor | None = None  # [rows, 1] each row's newest token, fed next
        self.procs: RowProcessors | None = None  # in step with the rows; None while none needs any

    def step(self, running: list[Seq], admit: list[Seq], partial: list[Seq] = ()) -> tuple[Step, Step]:
        """One forward for the next token of each of the first `len(running)` rows (`running`:
        their jobs; the other rows sit the step out) and the first token of each admitted job
        (a preempted one feeds its prompt and the tokens it had), which joins after every row:
        the keys/values of its prefix that the prefix cache holds are copied in, the rest is
        fed. The `partial` jobs feed their tokens up to `Seq.chunk` only, into the prefix cache
        (`_chunk`), and do not join. Returns (the running rows' tokens, the admitted jobs' first
        tokens)."""
        began = time.perf_counter()
        for seq in partial:
            self._chunk(seq)
        self.chunk_s = time.perf_counter() - began if partial else 0.0
        if not (running or admit):
            return ([], {}), ([], {})
        active, before = len(running), self.kv.rows
        fed = [s.fed for s in admit]
        lengths = [len(f) for f in fed]
        hits = [self._lookup(seq, f) for seq, f in zip(admit, fed)]
        cached = [len(h) * self.block for h in hits]
        positions = self.kv.begin(active, lengths, cached, shared=self._shared(running))
        for j, blocks in enumerate(hits):
            if blocks:
                self.prefix.fill(self.kv, *self.kv.placement(j, lengths[j]), blocks)
        ids = [self.next[:active, 0]] if active else []
        if fed:
            ids.append(torch.tensor([t for f, c in zip(fed, cached) for t in f[c:]], device=self.device))
        # The logits kept: each running row's, each admitted job's last position's, and every
        # position of a job that wants prompt_logprobs (on its first prefill).
        keep, last, spans = list(range(active)), [], {}
        at = active
        for r, (seq, n) in enumerate(zip(admit, lengths)):
            n -= cached[r]
            if self._wants_prompt_logprobs(seq):
                spans[r] = len(keep)
                keep.extend(range(at, at + n))
            else:
                keep.append(at + n - 1)
            last.append(len(keep) - 1)
            at += n
        out = self.lm(
            input_ids=torch.cat(ids).view(1, -1),
            position_ids=positions,
            past_key_values=self.kv.cache,
            use_cache=True,
            logits_to_keep=torch.tensor(keep, device=self.device),
        )
        self.kv.finish()
        if self.prefix is not None:
            for j, (seq, f) in enumerate(zip(admit, fed)):
                self.prefix.store(self.kv, before + j, f, seq.blocks)
        logits = out.logits[0]
        decoded = self._decoded(running, logits[:active], before) if active else ([], {})
        joined = self._joined(admit, fed, logits, last, spans, before) if admit else ([], {})
        return decoded, joined

    def _chunk(self, seq: Seq) -> None:
        """Prefill `seq`'s tokens up to `seq.chunk` after what the prefix cache holds of them,
        in a forward of its own over a one-row cache beside the batch's (so that the batch's
        window never widens for it), and keep them in the prefix cache."""
        if self.scratch is None:
            self.scratch = SlotKV(*self.kv.shape, self.kv.dtype, 1, self.kv.device)
        kv, fed = self.scratch, seq.fed[: seq.chunk]
        blocks = self._lookup(seq, fed)
        cached = len(blocks) * self.block
        positions = kv.begin(0, [len(fed)], [cached])
        if blocks:
            self.prefix.fill(kv, *kv.placement(0, len(fed)), blocks)
        self.lm(
            input_ids=torch.tensor([fed[cached:]], device=self.device),
            position_ids=positions,
            past_key_values=kv.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        kv.finish()
        self.prefix.store(kv, 0, fed, seq.blocks)
        kv.select([])

    def _shared(self, running: list[Seq]) -> int:
        """How many first tokens all the running rows share, in whole prefix-cache blocks (their
        names chain every token before them), if at least CASCADE_MIN_TOKENS; else 0."""
        if self.prefix is None or len(running) < 2:
            return 0
        chains = [s.blocks for s in running]
        first, common = chains[0], min(map(len, chains))
        for n in range(common):
            if any(c[n] != first[n] for c in chains):
                common = n
                break
        shared = common * self.block
        return shared if shared >= CASCADE_MIN_TOKENS else 0

    @staticmethod
    def _wants_prompt_logprobs(seq: Seq) -> bool:
        """Its prefill must compute every prompt position's logits (its first one)."""
        return seq.spec.params.prompt_logprobs is not None and seq.prompt_lp is None

    def _caches(self, seq: Seq) -> bool:
        """Whether `seq`'s prefill may take its prefix from the cache."""
        return self.prefix is not None and not self._wants_prompt_logprobs(seq)

    def _lookup(self, seq: Seq, fed: list[int]) -> list[int]:
        """The prefix cache's blocks for `seq`'s first tokens (none for a job that wants its
        prompt's logprobs: every position must be computed); a job's first prefill counts in
        the cache's queries and hits, as vLLM's."""
        if not self._caches(seq):
            return []
        blocks = self.prefix.match(fed, seq.blocks)
        if not seq.looked:
            seq.looked, seq.cached = True, len(blocks) * self.block
            self.prefix.queries += len(seq.prompt_ids)
            self.prefix.hits += seq.cached
        return blocks

    def missing(self, seq: Seq) -> bytes | None:
        """The name of the first block of `seq`'s tokens that the prefix cache could give but
        lacks (None: it lacks none, or the job would not use it)."""
        if not self._caches(seq):
            return None
        fed = seq.fed
        found = self.prefix.peek(fed, seq.blocks)
        return seq.blocks[found] if found < (len(fed) - 1) // self.block else None

    def cached(self, seq: Seq) -> int:
        """How many of `seq`'s tokens the prefix cache holds now, as a prefill would use them."""
        if not self._caches(seq):
            return 0
        return self.prefix.peek(seq.fed, seq.blocks) * self.block

    def remember(self, row: int, seq: Seq) -> None:
        """Before `row` leaves the batch: its tokens' keys/values go into the prefix cache."""
        if self.prefix is not None:
            count = int(self.kv.mask[row, self.kv.start : self.kv.end].sum())
            self.prefix.store(self.kv, row, seq.fed[:count], seq.blocks)

    def _decoded(self, seqs: list[Seq], raw: torch.Tensor, rows: int) -> Step:
        """The running rows' next tokens; they are fed next."""
        active = len(seqs)
        everyone = active == rows
        procs = self.procs if everyone or self.procs is None else self.procs.head(active)
        tokens = self._choose(seqs, raw, procs)
        lps = self._logprobs(seqs, raw, tokens)
        if everyone:
            self.next = tokens.view(-1, 1).to(self.device)
        else:
            self.next[:active, 0] = tokens.to(self.device)
        return tokens.tolist(), lps

    def _joined(self, seqs: list[Seq], fed: list[list[int]], logits, last: list[int], spans: dict, rows: int) -> Step:
        """The admitted jobs' first tokens; their rows follow the `rows` running ones."""
        if spans:
            self._prompt_logprobs(seqs, spans, logits)
        raw = logits[last]
        vocab = raw.shape[-1]
        procs = RowProcessors.build(
            [s.spec.params for s in seqs],
            fed,
            [min(s.spec.params.min_tokens, s.max_new) for s in seqs],
            self.eos,
            vocab,
            outputs=[s.out for s in seqs],
            tokenizer=self.tok,
        )
        first = self._choose(seqs, raw, procs)
        lps = self._logprobs(seqs, raw, first)
        self.procs = RowProcessors.join(self.procs, procs, rows, len(seqs), vocab)
        nxt = first.view(-1, 1).to(self.device)
        self.next = nxt if self.next is None or not rows else torch.cat([self.next, nxt])
        return first.tolist(), lps

    # -- the runner's per-row state follows the batch's rows (worker/engines/rows.py) ---------

    def move(self, order: list[int]) -> None:
        """Row i is now old row order[i]; the others are gone."""
        if not order:
            self.next, self.procs = None, None
        else:
            self._follow(order)

    def swap(self, a: list[int], b: list[int]) -> None:
        """Exchange rows a[i] and b[i] (disjoint)."""
        order = list(range(self.next.shape[0]))
        for x, y in zip(a, b, strict=True):
            order[x], order[y] = y, x
        self._follow(order)

    def _follow(self, order: list[int]) -> None:
        idx = torch.tensor(order)
        if self.procs is not None:
            self.procs = self.procs.select(idx)
        self.next = self.next.index_select(0, idx.to(self.device))

    def _choose(self, seqs: list[Seq], raw: torch.Tensor, procs: RowProcessors | None) -> torch.Tensor:
        """Each row's next token, on the CPU: from the raw logits, or the processed ones where a
        row of the batch asked for penalties or min_tokens. Sampling, the processors and the
        seeded generators stay on the CPU whatever the model's device (the same draws for a
        seed on every device); a greedy batch copies only its tokens back from a GPU."""
        if procs is None and raw.device.type != "cpu" and all(s.spec.params.greedy for s in seqs):
            return raw.max(-1).indices.cpu()
        raw = raw.cpu()
        if procs is None:
            return sample(raw, [s.spec.params for s in seqs], [s.generator for s in seqs])
        tokens = sample(procs.apply(raw), [s.spec.params for s in seqs], [s.generator for s in seqs])
        procs.update(tokens)
        return tokens

    @staticmethod
    def _prompt_logprobs(seqs: list[Seq], spans: dict[int, int], logits: torch.Tensor) -> None:
        """Each row's prompt tokens' log-probabilities (from the second: what the positions
        before predicted), their ranks and the `prompt_logprobs` likeliest there (vLLM's);
        `spans`: row -> where its prompt's logits begin in `logits`."""
        for r, at in spans.items():
            seq, n = seqs[r], len(seqs[r].prompt_ids)
            lp = logits[at : at + n - 1].float().cpu().log_softmax(-1)
            target = torch.tensor(seq.prompt_ids[1:]).view(-1, 1)
            chosen = lp.gather(1, target)
            ranks = (lp > chosen).sum(-1) + 1
            k = seq.spec.params.prompt_logprobs
            top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
            seq.prompt_lp = [
                (t, max(c, LOGPROB_FLOOR), rank, list(zip(i, [max(x, LOGPROB_FLOOR) for x in v])))
                for t, c, rank, i, v in zip(
                    seq.prompt_ids[1:], chosen.view(-1).tolist(), ranks.tolist(), top_i.tolist(), top_v.tolist()
                )
            ]

    @staticmethod
    def _logprobs(seqs: list[Seq], raw: torch.Tensor, tokens: torch.Tensor) -> dict:
        """row -> (the chosen token's log-probability, the row's top ones), for the rows that
        asked for log-probabilities."""
        rows = [i for i, s in enumerate(seqs) if s.lp is not None]
        if not rows:
            return {}
        top = [seqs[i].spec.params.logprobs for i in rows]
        return dict(zip(rows, logprobs(raw.cpu(), tokens, rows, top)))
