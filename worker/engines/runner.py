"""The hf engine's model runner: the forwards, the sampling and the KV cache's rows.

`prefill` runs the arriving jobs' prompts together (left-padded, each row's own
`position_ids`) and copies only their keys/values into free rows of the batch's cache
(worker/engines/kvcache.py); `decode` feeds each running row's newest token, or only the first
rows' (the others sit the step out); both choose each row's next token on the CPU, through the
batch's logits processors where a row asks for them (worker/engines/logits.py), with the
log-probabilities of the rows that want them. `select` and `swap` move rows; the per-row state
here (the processors, the next tokens) follows, and the caller gets the new order.
"""

from __future__ import annotations

import torch

from worker.engines.kvcache import SlotKV
from worker.engines.logits import LOGPROB_FLOOR, RowProcessors, logprobs, sample
from worker.engines.scheduler import Seq

Step = tuple[list[int], dict]  # each row's token, and {row: (logprob, top)} for the rows that want them


class ModelRunner:
    def __init__(self, lm, kv: SlotKV, device: torch.device, pad: int, eos: int | None, tok=None):
        self.lm, self.kv, self.device, self.pad, self.eos, self.tok = lm, kv, device, pad, eos, tok
        # The logits' width (the output layer's; it may exceed the tokenizer's vocabulary).
        head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
        self.vocab = head.weight.shape[0] if head is not None else lm.config.vocab_size
        self.next: torch.Tensor | None = None  # [rows, 1] each row's newest token, fed next
        self.procs: RowProcessors | None = None  # in step with the rows; None while none needs any

    def prefill(self, seqs: list[Seq], running: int) -> Step:
        """Prefill the new jobs together (a preempted one: its prompt and the tokens it had)
        and join them after the `running` rows; returns their first tokens."""
        fed = [s.fed for s in seqs]
        width = max(map(len, fed))
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, tokens in enumerate(fed):
            ids[row, width - len(tokens) :] = torch.tensor(tokens)
            mask[row, width - len(tokens) :] = 1
        # Each row's own positions, whatever its left padding (OPT derives them from the mask;
        # most architectures would otherwise number every row's columns from 0 alike).
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, positions = (t.to(self.device) for t in (ids, mask, positions))
        # Rows that want prompt_logprobs (on their first prefill) need every position's logits.
        every = [r for r, s in enumerate(seqs) if s.spec.params.prompt_logprobs is not None and s.prompt_lp is None]
        out = self.lm(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=0 if every else 1
        )
        if every:
            self._prompt_logprobs(seqs, every, out.logits, width)
        raw = out.logits[:, -1, :]
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
        self.procs = RowProcessors.join(self.procs, procs, running, len(seqs), vocab)
        self.kv.append(out.past_key_values, mask)
        nxt = first.view(-1, 1).to(self.device)
        self.next = nxt if self.next is None else torch.cat([self.next, nxt])
        return first.tolist(), lps

    def decode(self, seqs: list[Seq], rows: int) -> Step:
        """One decode step of the first `rows` rows (`seqs`: those rows' jobs); the other
        rows get a masked column and go on later where they were."""
        out = self.lm(
            input_ids=self.next[:rows],
            position_ids=self.kv.positions(rows),
            attention_mask=self.kv.step_mask(rows),
            past_key_values=self.kv.cache,
            use_cache=True,
        )
        self.kv.advance()
        raw = out.logits[:, -1, :]
        everyone = rows == self.kv.rows
        procs = self.procs if everyone or self.procs is None else self.procs.head(rows)
        tokens = self._choose(seqs, raw, procs)
        lps = self._logprobs(seqs, raw, tokens)
        if everyone:
            self.next = tokens.view(-1, 1).to(self.device)
        else:
            self.next[:rows, 0] = tokens.to(self.device)
        return tokens.tolist(), lps

    def select(self, keep: list[int]) -> list[int]:
        """Keep only the rows in `keep` (ascending); returns each row's old index, in the new
        order (the KV cache moves its last rows into the holes)."""
        order = self.kv.select(keep)
        if not keep:
            self.next, self.procs = None, None
        else:
            self._follow(order)
        return order

    def swap(self, a: list[int], b: list[int]) -> None:
        """Exchange rows a[i] and b[i] (disjoint)."""
        if not a:
            return
        self.kv.swap(a, b)
        order = list(range(self.kv.rows))
        for x, y in zip(a, b):
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
            return raw.argmax(-1).cpu()
        raw = raw.cpu()
        if procs is None:
            return sample(raw, [s.spec.params for s in seqs], [s.generator for s in seqs])
        tokens = sample(procs.apply(raw), [s.spec.params for s in seqs], [s.generator for s in seqs])
        procs.update(tokens)
        return tokens

    @staticmethod
    def _prompt_logprobs(seqs: list[Seq], rows: list[int], logits: torch.Tensor, width: int) -> None:
        """Each row's prompt tokens' log-probabilities (from the second: what the positions
        before predicted), their ranks and the `prompt_logprobs` likeliest there (vLLM's)."""
        for r in rows:
            seq, n = seqs[r], len(seqs[r].prompt_ids)
            lp = logits[r, width - n : width - 1].float().cpu().log_softmax(-1)
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
