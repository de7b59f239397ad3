"""The vLLM engine: one `AsyncLLM` per worker process, fed by every Celery task thread.

vLLM does its own continuous batching; this module only bridges threads and asyncio. An event
loop runs in a thread of its own; `submit` schedules one coroutine per job on it, which
iterates vLLM's output deltas and hands them to the sink as token events. vLLM is imported
only here, so the API and the hf worker run without it installed. It starts its engine core in
processes of its own (spawned, never forked).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from concurrent.futures import Future

from tasks.config import Settings
from tasks.schemas import GenerationResult, JobSpec, Logprobs
from tasks.streams import TokenEvent
from worker.engines.base import DirectSink, Engine, GenerationError, JobCancelled, Sink
from worker.engines.dtype import resolve as resolve_dtype

log = logging.getLogger(__name__)


def _has_gpu() -> bool:
    """vLLM's CUDA build on a machine with a GPU (the CPU build has no usable CUDA)."""
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch, or a CUDA build without a driver
        return False


def compact_json_grammar(so) -> str:
    """The EBNF of a JSON schema (or any object) without whitespace between JSON's tokens, as
    the hf engine compiles it (worker/engines/structured.py)."""
    import xgrammar as xgr

    from worker.engines.structured import GrammarError, field_of, first_line, string_lengths

    schema = string_lengths(json.loads(so.json_schema)) if so.json_schema is not None else {"type": "object"}
    try:
        return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":")))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(field_of(so), first_line(exc)) from None


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(self, settings: Settings, sink: Sink | None = None):
        # CPU builds size their KV cache from this (GiB); GPU builds ignore it.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.vllm_kv_cache_gib))
        from transformers import AutoTokenizer
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.v1.engine.async_llm import AsyncLLM

        self._SamplingParams, self._DELTA, self._ClientError = SamplingParams, RequestOutputKind.DELTA, VLLMClientError
        self._StructuredOutputsParams = StructuredOutputsParams
        self.sink = sink or DirectSink()
        self.model = settings.served_model
        self.capacity = settings.max_batch_size
        self.default_max_new = settings.default_max_new_tokens
        self.job_timeout = settings.job_timeout
        self.tok = AutoTokenizer.from_pretrained(settings.model)
        self._active = 0

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="genq-vllm-loop", daemon=True)
        self._thread.start()
        dtype, why = resolve_dtype(settings.dtype, gpu=_has_gpu())
        log.info("weights in %s (%s)", dtype, why)
        args = AsyncEngineArgs(
            model=settings.model,
            tokenizer=settings.model,
            served_model_name=[settings.served_model],
            dtype=dtype,
            enforce_eager=settings.vllm_enforce_eager,
            max_num_seqs=settings.max_batch_size,
            gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
            tensor_parallel_size=settings.vllm_tensor_parallel_size,
            max_model_len=settings.vllm_max_model_len,
            disable_log_stats=True,
            # Structured output applies to what follows the reasoning (as the hf engine's
            # `StructuredOutput.after`), vLLM's own way: its reasoning parser finds the end.
            reasoning_parser=settings.reasoning_parser or "",
        )

        async def _start():
            return AsyncLLM.from_engine_args(args)

        self.llm = asyncio.run_coroutine_threadsafe(_start(), self.loop).result()
        self.max_model_len = self.llm.model_config.max_model_len
        # vLLM's automatic prefix caching (on by default in its V1 engine).
        cache = getattr(getattr(self.llm, "vllm_config", None), "cache_config", None)
        self.caches_prefixes = bool(getattr(cache, "enable_prefix_caching", False))
        self.device = "cuda" if _has_gpu() else "cpu"  # vLLM's own placement (its workers' GPUs)

    def submit(self, spec: JobSpec) -> Future[GenerationResult]:
        p = spec.params
        if spec.prompt_token_ids is not None:
            ids = list(spec.prompt_token_ids)
        else:
            # A chat prompt (rendered by worker/chat.py) holds its special tokens already.
            add = p.add_special_tokens if p.add_special_tokens is not None else spec.chat is None
            ids = self.tok(spec.prompt, add_special_tokens=add).input_ids
        if p.truncate_prompt_tokens is not None:
            keep = self.max_model_len if p.truncate_prompt_tokens == -1 else p.truncate_prompt_tokens
            ids = ids[-keep:]
        n_prompt = len(ids)
        max_new = spec.params.max_new_tokens or self.default_max_new
        if n_prompt + max_new > self.max_model_len:
            raise GenerationError(
                "prompt_too_long",
                f"the prompt has {n_prompt} tokens; with max_new_tokens={max_new} that exceeds "
                f"the model's context of {self.max_model_len} tokens",
            )
        # A constraint vLLM cannot take fails the job here, naming its field (as the hf engine's).
        structured = self._structured(p.structured_outputs)
        future: Future[GenerationResult] = Future()
        # The prompt as token ids: tokenized here (add_special_tokens, truncate_prompt_tokens), or as sent.
        prompt = {"prompt_token_ids": ids}
        asyncio.run_coroutine_threadsafe(self._generate(spec, prompt, max_new, future, structured), self.loop)
        return future

    def cancel(self, job_id: str) -> None:
        asyncio.run_coroutine_threadsafe(self.llm.abort(job_id), self.loop)

    def close(self) -> None:
        llm, self.llm = self.llm, None
        try:
            llm.shutdown()
            del llm  # now, not from __del__ at interpreter exit, when vLLM's modules are gone
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

    def _structured(self, so):
        """vLLM's StructuredOutputsParams of the job's StructuredOutput (or None)."""
        if so is None:
            return None
        if so.disable_any_whitespace and (so.json_schema is not None or so.json_object):
            # vLLM's xgrammar backend reads only its engine-wide disable_any_whitespace: the
            # job's compact JSON goes to it as the grammar xgrammar makes of the schema.
            return self._StructuredOutputsParams(grammar=compact_json_grammar(so))
        kind = (
            {"json": so.json_schema}
            if so.json_schema is not None
            else {"json_object": True}
            if so.json_object
            else {"regex": so.regex}
            if so.regex is not None
            else {"choice": so.choice}
            if so.choice is not None
            else {"grammar": so.grammar}
        )
        return self._StructuredOutputsParams(**kind, disable_any_whitespace=so.disable_any_whitespace)

    def _prompt_logprobs(self, positions) -> list:
        """vLLM's prompt logprobs ({token id: Logprob} per position, None first) as the result's."""
        out = []
        for pos in positions:
            if pos is None:
                out.append(None)
                continue
            out.append(
                {
                    str(t): {
                        "logprob": max(v.logprob, -9999.0),
                        "rank": v.rank,
                        "decoded_token": v.decoded_token if v.decoded_token is not None else self.tok.decode([t]),
                    }
                    for t, v in pos.items()
                }
            )
        return out

    async def _generate(self, spec: JobSpec, prompt: dict, max_new: int, future: Future, structured=None) -> None:
        p = spec.params
        params = self._SamplingParams(
            max_tokens=max_new,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
            stop=p.stop or None,
            ignore_eos=p.ignore_eos,
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            min_tokens=min(p.min_tokens, max_new),
            stop_token_ids=p.stop_token_ids or None,
            logprobs=p.logprobs,
            min_p=p.min_p,
            logit_bias=p.logit_bias or None,
            allowed_token_ids=p.allowed_token_ids,
            bad_words=p.bad_words or None,
            include_stop_str_in_output=p.include_stop_str_in_output,
            skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens,
            prompt_logprobs=p.prompt_logprobs,
            structured_outputs=structured,
            output_kind=self._DELTA,
        )
        self._active += 1
        peak, index, text, tokens, prompt_tokens, cached = self._active, 0, [], 0, 0, 0
        token_ids, prompt_ids, prompt_lp = [], None, None
        finish, stop_reason, last, last_lp = None, None, "", None
        logprobs, offset = (Logprobs(), 0) if p.logprobs is not None else (None, 0)
        left, why = self.time_limit(spec)
        try:
            async with asyncio.timeout(left):
                async for out in self.llm.generate(prompt, params, spec.id):
                    peak = max(peak, self._active)
                    prompt_tokens = len(out.prompt_token_ids or []) or prompt_tokens
                    prompt_ids = out.prompt_token_ids or prompt_ids
                    # Its prefix-cache hits: known once the prompt's prefill is scheduled.
                    cached = out.num_cached_tokens or cached
                    if out.prompt_logprobs is not None and prompt_lp is None:
                        prompt_lp = self._prompt_logprobs(out.prompt_logprobs)
                    completion = out.outputs[0]
                    tokens += len(completion.token_ids)
                    token_ids += completion.token_ids
                    if completion.text:
                        text.append(completion.text)
                    lp = None
                    if logprobs is not None and completion.logprobs:
                        lp, offset = self._logprobs(completion.token_ids, completion.logprobs, offset)
                        logprobs.extend(lp)
                        lp = lp.model_dump()
                    if out.finished:
                        finish, stop_reason = completion.finish_reason, completion.stop_reason
                        last, last_lp = completion.text, lp
                        break
                    if spec.stream:
                        self.sink.emit([(spec.id, TokenEvent(index, completion.text, logprobs=lp))], [])
                    index += 1
        except TimeoutError:
            await self.llm.abort(spec.id)
            partial = GenerationResult(
                text="".join(text),
                finish_reason="timeout",
                prompt_tokens=prompt_tokens,
                completion_tokens=tokens,
                cached_tokens=cached,
                batch_size=peak,
                model=self.model,
                logprobs=logprobs,
            )
            future.set_exception(GenerationError("timeout", why, partial))
            return
        except self._ClientError as exc:
            future.set_exception(GenerationError("invalid_request", str(exc)))
            return
        except Exception as exc:  # the engine failed this job, not the worker
            log.exception("vLLM failed job %s", spec.id)
            future.set_exception(GenerationError("engine_error", repr(exc)))
            return
        finally:
            self._active -= 1
        if finish in (None, "abort"):
            future.set_exception(JobCancelled(spec.id))
            return
        reason = {"length": "length"}.get(finish) or ("stop" if isinstance(stop_reason, str) else "eos")
        result = GenerationResult(
            text="".join(text),
            finish_reason=reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=tokens,
            cached_tokens=cached,
            batch_size=peak,
            model=self.model,
            logprobs=logprobs,
            prompt_logprobs=prompt_lp,
            prompt_token_ids=list(prompt_ids or prompt["prompt_token_ids"]) if p.return_token_ids else None,
            token_ids=token_ids if p.return_token_ids else None,
        )
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "cached_tokens": cached}
        final = (
            [(spec.id, TokenEvent(index, last, finish=reason, usage=usage, logprobs=last_lp))] if spec.stream else []
        )
        self.sink.emit(final, [(future, result)])

    def _logprobs(self, token_ids, positions, offset: int) -> tuple[Logprobs, int]:
        """vLLM's log-probabilities of these new tokens in OpenAI's format (as vLLM's own server
        writes them: each position's chosen token and its top ones), and the text offset after
        them."""

        def piece(t: int, logprob) -> str:
            return logprob.decoded_token if logprob.decoded_token is not None else self.tok.decode([t])

        lp = Logprobs()
        for token_id, position in zip(token_ids, positions):
            if not position:
                continue
            chosen = position.get(token_id)
            token = piece(token_id, chosen) if chosen is not None else self.tok.decode([token_id])
            lp.tokens.append(token)
            lp.token_logprobs.append(max(chosen.logprob, -9999.0) if chosen is not None else -9999.0)
            lp.top_logprobs.append({piece(t, v): max(v.logprob, -9999.0) for t, v in position.items()})
            lp.text_offset.append(offset)
            offset += len(token)
        return lp, offset
