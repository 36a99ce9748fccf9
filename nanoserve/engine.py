"""Engine: the step loop and the public methods. The only room that knows every other room."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from nanoserve.blocks import BlockAllocator
from nanoserve.config import EngineConfig
from nanoserve.detokenize import IncrementalDetokenizer
from nanoserve.inputs import build_inputs
from nanoserve.model.kv_cache import KVCache, bytes_per_block
from nanoserve.model.llama import LlamaModel
from nanoserve.model.prepare import prepare_model
from nanoserve.output_processor import OutputProcessor, TokenBatch, check_in_row_order
from nanoserve.params import SamplingParams
from nanoserve.recorder import NULL_RECORDER
from nanoserve.request import FinishReason, Request, RequestOutput
from nanoserve.sampling import BatchedSampler, RowHistory
from nanoserve.scheduler import Scheduler, SchedulerOutput, cdiv


@dataclass
class SampledStep:
    """One step's sampled tokens, still on the device, and the requests that own the rows."""

    batch: TokenBatch  # [rows] int64 + request ids
    requests: list[Request]  # row order; identity tells a live row from overshoot
    logprobs: tuple[list[int], torch.Tensor] | None  # rows asking, [those rows, 1 + 2k] on the device


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_steps: int


class Engine:
    """Continuous-batching inference over a paged KV cache.

    Args:
        model: a LlamaModel already on config.device in config.dtype.
        tokenizer: a Hugging Face tokenizer, or None (then prompts must be token ids and text is "").
        config: the EngineConfig.
    Raises:
        ValueError: when config.max_model_len exceeds what the model can position, or the model's
            dtype or device differs from the config's.
    """

    def __init__(self, model: LlamaModel, tokenizer: Any = None, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.device = torch.device(config.device)
        if model.dtype != config.torch_dtype or model.device.type != self.device.type:
            raise ValueError(f"the model is {model.dtype} on {model.device}, the config asks for "
                             f"dtype={config.dtype!r} on device={config.device!r}")
        model = self.model = prepare_model(model, pack_weights=config.pack_weights, compile=config.compile)
        num_positions = model.cos.shape[0]
        self.max_model_len = config.max_model_len or num_positions
        if self.max_model_len > num_positions:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's {num_positions} positions")
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens={config.max_num_batched_tokens} is below max_model_len="
                             f"{self.max_model_len}: without chunked prefill a long prompt could never be scheduled")
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        num_blocks = config.num_kv_blocks or max(
            1, config.kv_cache_memory_bytes // bytes_per_block(model.config, config.block_size, model.dtype)
        )
        self.kv = KVCache(model.config, num_blocks, config.block_size, model.dtype, self.device)
        self.allocator = BlockAllocator(num_blocks)
        self.scheduler = Scheduler(self.allocator, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_chunked_prefill,
                                   config.enable_prefix_caching)
        self.sampler = BatchedSampler()
        self.output = OutputProcessor()
        self.recorder = NULL_RECORDER
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self._generators: dict[str, torch.Generator] = {}  # seeded requests' own noise
        self._default_generator = torch.Generator(self.device).manual_seed(config.seed)
        self._ids = itertools.count()
        self._in_flight: SampledStep | None = None  # deferred mode: sampled, not yet brought home
        self._held: dict[str, list[Request]] = {}  # n > 1: first copy's id -> copies waiting for its prefill
        self._groups: dict[str, list[str]] = {}  # n > 1: group id -> its copies' ids
        self.num_steps = 0

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, config: EngineConfig | None = None) -> Engine:
        """Loads a Hugging Face Llama-family checkpoint directory; None loads the embedded default model."""
        from transformers import AutoTokenizer

        from nanoserve.model.default import default_model_dir
        from nanoserve.model.weights import load_model

        config = config or EngineConfig()
        path = Path(path) if path is not None else default_model_dir()
        model = load_model(path, config.torch_dtype, config.device, max_positions=config.max_model_len)
        return cls(model, AutoTokenizer.from_pretrained(path), config)

    # ---- requests in -------------------------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Validates and queues one request; returns its id.

        Raises:
            ValueError: empty prompt, token id outside the vocabulary, prompt plus max_tokens over
                max_model_len, a request the whole KV pool could not hold, or a duplicate id.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={params.stop!r} needs a tokenizer; this engine has none")
        token_ids = self._tokenize(prompt)
        vocab = self.model.config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds max_model_len={self.max_model_len}")
        blocks = cdiv(total, self.config.block_size)
        if blocks > self.allocator.num_blocks:
            raise ValueError(f"request needs {blocks} KV blocks at full length, the whole pool has "
                             f"{self.allocator.num_blocks}")
        if request_id is None:
            request_id = str(next(self._ids))
            while self._in_use(request_id, params.n):  # a caller may have chosen the next number already
                request_id = str(next(self._ids))
        elif self._in_use(request_id, params.n):
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.n == 1:
            requests = [Request(request_id, token_ids, params, self.eos_token_ids, arrival_time)]
        else:
            # n copies of the prompt: the first is admitted alone, the rest when its prefill is
            # done, so they find its full blocks in the prefix cache instead of recomputing them.
            requests = []
            for i in range(params.n):
                seed = None if params.seed is None else params.seed + i
                child = Request(f"{request_id}.{i}", token_ids, replace(params, n=1, seed=seed), self.eos_token_ids,
                                arrival_time)
                child.parent_id, child.index = request_id, i
                requests.append(child)
            self._held[requests[0].request_id] = requests[1:]
            self._groups[request_id] = [r.request_id for r in requests]
        for request in requests:
            if self.tokenizer is not None:
                request.detokenizer = IncrementalDetokenizer(self.tokenizer)
            if request.params.seed is not None:
                self._generators[request.request_id] = torch.Generator(self.device).manual_seed(request.params.seed)
            self.requests[request.request_id] = request
        self.scheduler.add(requests[0])
        return request_id

    def _in_use(self, request_id: str, n: int) -> bool:
        ids = [request_id] if n == 1 else [f"{request_id}.{i}" for i in range(n)]
        return request_id in self._groups or any(i in self.requests for i in ids)

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: it needs at least 1 token")
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; this engine has none, pass token ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("prompt is empty: it needs at least 1 token")
        return token_ids

    def abort(self, request_id: str) -> RequestOutput:
        """Stops a request and returns its blocks to the pool.

        Raises:
            ValueError: the id is not an unfinished request of this engine.
        """
        if request_id in self._groups:  # n > 1: every unfinished completion
            children = [c for c in self._groups.pop(request_id) if c in self.requests]
            return [self.abort(c) for c in children][-1] if children else None
        request = self.requests.get(request_id)
        if request is None:
            raise ValueError(f"request_id {request_id!r} is not an unfinished request")
        request.finish(FinishReason.ABORT, time.perf_counter())
        self._retire(request)
        return self._make_output(request)

    def _retire(self, request: Request) -> None:
        """Forgets a finished request: blocks back to the pool, its group closed when it was the last."""
        self._release_held(request)
        self.scheduler.finish(request)
        del self.requests[request.request_id]
        self._generators.pop(request.request_id, None)
        group = self._groups.get(request.parent_id) if request.parent_id else None
        if group is not None and not any(c in self.requests or c in self._held for c in group):
            del self._groups[request.parent_id]

    def _release_held(self, request: Request) -> None:
        """Queues the held copies of an n > 1 request once its first copy no longer needs them held."""
        held = self._held.pop(request.request_id, None)
        if held:
            self.scheduler.add_next(held)

    # ---- the step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Runs one iteration: schedule, sync_rows, build_inputs, forward, sample, collect.

        Returns the outputs of the requests that received a token (or finished) in this step's
        collect. With config.deferred_output, collect resolves the *previous* step's tokens after
        this step's forward was launched, so the readback never idles the device; the next
        decode's input ids come from the device tensor, and a stop found one step late discards
        its one token of overshoot.
        """
        rec = self.recorder
        deferred = self.config.deferred_output
        rec.begin_step()
        with rec.phase("schedule"):
            outputs: list[RequestOutput] = []
            if self._in_flight is not None and any(r.params.needs_history for r in self._in_flight.requests):
                outputs = self._flush()  # penalties and min_tokens must see every token: resolve now
            sched = self.scheduler.schedule()
        if sched.is_empty:
            if self._in_flight is not None:
                outputs += self._flush()
            rec.end_step(num_rows=0, num_tokens=0, num_decode_rows=0)
            return outputs
        with rec.phase("sync_rows"):
            rows = [item.request for item in sched.scheduled if item.samples]
            previous, self._in_flight = self._in_flight, None
        with rec.phase("build_inputs"):
            inputs = build_inputs(sched, self.config.block_size, self.device, previous, self.config.decode_group_min_rows)
        with rec.phase("forward"):
            logits = self.model.forward(inputs, self.kv)  # [rows, V]
        with rec.phase("sample"):
            batch = self._sample(logits, rows)
            logprobs = self._logprobs(logits, batch.tokens, rows) if any(r.params.logprobs is not None for r in rows) else None
            sampled = SampledStep(batch, rows, logprobs)
        with rec.phase("collect", syncs=not deferred):
            outputs += self._collect(sched, previous if deferred else sampled)
            if deferred:
                self._in_flight = sampled
        self.num_steps += 1
        rec.end_step(num_rows=len(rows), num_tokens=sched.num_batched_tokens,
                     num_decode_rows=sum(1 for item in sched.scheduled if item.num_new_tokens == 1))
        return outputs

    def _flush(self) -> list[RequestOutput]:
        """Resolves the step still in flight when nothing new is scheduled (deferred mode)."""
        sampled, self._in_flight = self._in_flight, None
        return self._resolve(sampled)

    def _sample(self, logits: torch.Tensor, rows: list[Request]) -> TokenBatch:
        """Samples every row's next token; the tokens stay on the device."""
        params = [r.params for r in rows]
        generators = [self._generators.get(r.request_id) for r in rows] if self._generators else None
        histories = None
        if any(p.needs_history for p in params):
            histories = [
                RowHistory(r.prompt_token_ids, r.output_token_ids, self.eos_token_ids | set(r.params.stop_token_ids))
                if r.params.needs_history else None
                for r in rows
            ]
        tokens = self.sampler.sample_batch_device(logits, params, generators, self._default_generator, histories)
        if self.config.deferred_output:
            for r in rows:
                r.num_pending_tokens += 1  # sampled, not yet home: the scheduler may already decode it
        return TokenBatch(tokens, tuple(r.request_id for r in rows), self.output.readback)

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, requests: list[Request]) -> tuple[list[int], torch.Tensor]:
        """The model's own log-probabilities (before penalties and temperature, as vLLM reports them)
        of the sampled token and the top k, packed per row as [sampled, k values, k ids] on the device."""
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        k = max(requests[i].params.logprobs for i in rows)
        index = torch.tensor(rows, device=logits.device)
        logprobs = torch.log_softmax(logits[index].float(), dim=-1)  # [L, V]
        sampled = logprobs.gather(1, tokens[index][:, None])  # [L, 1]
        top = logprobs.topk(k, dim=-1)  # [L, k] values and ids
        return rows, torch.cat([sampled, top.values, top.indices.float()], dim=1)  # [L, 1 + 2k]

    def _collect(self, sched: SchedulerOutput, sampled: SampledStep | None) -> list[RequestOutput]:
        """Advances the counters of what this step forwarded, then brings one sampled step home."""
        for item in sched.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
            if item.samples and self._held:
                self._release_held(item.request)  # its prompt is in the cache now
        if self.scheduler.enable_prefix_caching:  # before _resolve frees the blocks of finished requests
            for item in sched.scheduled:
                self.scheduler.cache_full_blocks(item.request)
        return self._resolve(sampled) if sampled is not None else []

    def _resolve(self, sampled: SampledStep) -> list[RequestOutput]:
        """One readback; each token goes through its request's stop rules."""
        check_in_row_order(sampled.batch, tuple(r.request_id for r in sampled.requests))
        outputs: list[RequestOutput] = []
        now = time.perf_counter()  # the tokens of one step arrive together, after its one readback
        rows = iter(sampled.requests)

        def append(request_id: str, token_id: int) -> None:
            request = next(rows)
            if self.requests.get(request_id) is not request:
                return  # finished or aborted after this token was launched: overshoot, discarded
            if request.num_pending_tokens:
                request.num_pending_tokens -= 1
            finished = request.append_token(token_id, now)
            if request.detokenizer is not None:
                request.detokenizer.add((token_id,))
            if not finished and request.params.stop and request.num_output_tokens >= request.params.min_tokens:
                finished = self._check_stop_strings(request, now)
            if finished:
                self._retire(request)
            outputs.append(self._make_output(request))

        if sampled.logprobs is not None:
            self._attach_logprobs(sampled)
        self.output.apply(sampled.batch, append)
        return outputs

    def _attach_logprobs(self, sampled: SampledStep) -> None:
        rows, packed = sampled.logprobs
        values = self.output.readback.fetch(packed.flatten())  # the one extra journey logprobs cost
        width = packed.shape[1]
        k = (width - 1) // 2
        tokens = sampled.batch.resolve()
        for n, row in enumerate(rows):
            chunk = values[n * width:(n + 1) * width]
            request = sampled.requests[row]
            if self.requests.get(request.request_id) is not request:
                continue  # overshoot
            want = request.params.logprobs
            entry = {int(i): v for i, v in zip(chunk[1 + k:1 + k + want], chunk[1:1 + want], strict=True)}
            entry[tokens[row]] = chunk[0]
            request.logprobs.append(entry)

    def _check_stop_strings(self, request: Request, now: float) -> bool:
        """Ends the request at the first stop string in its text; the text is cut before the match."""
        text = request.detokenizer.text
        # Only a match that ends in the newest text is new: earlier text was checked already.
        start = max(0, request.num_stop_scanned_chars - max(len(s) for s in request.params.stop) + 1)
        request.num_stop_scanned_chars = len(text)
        found = [(idx, stop) for stop in request.params.stop if (idx := text.find(stop, start)) >= 0]
        if not found:
            return False
        idx, stop = min(found)
        request.stop_text, request.stop_reason = text[:idx], stop
        request.finish(FinishReason.STOP, now)
        return True

    def _make_output(self, request: Request) -> RequestOutput:
        output_ids = request.output_token_ids
        detokenizer = request.detokenizer
        if request.stop_text is not None:
            text = request.stop_text
        elif detokenizer is not None:
            if request.is_finished:
                detokenizer.flush()  # the held-back tail of a half character, as the full decode has it
            text = detokenizer.text
        else:
            text = ""
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=output_ids,
            text=text,
            finished=request.is_finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finished_time=request.finished_time,
            token_times=list(request.token_times),
            running_s=request.running_s,
            num_preemptions=request.num_preemptions,
            num_cached_tokens=request.num_cached_tokens,
            stop_reason=request.stop_reason,
            logprobs=list(request.logprobs) if request.logprobs is not None else None,
            parent_id=request.parent_id,
            index=request.index,
        )

    # ---- convenience -------------------------------------------------------------------------

    def warmup(self, prompt_len: int = 32, num_seqs: int = 2, max_tokens: int = 4) -> float:
        """Runs a small uncounted workload (prefill and decode shapes) and returns its seconds:
        with config.compile this is the compile cost, paid once per process."""
        if self.has_unfinished():
            raise ValueError("warmup needs an idle engine")
        start = time.perf_counter()
        prompt = list(range(prompt_len))
        self.generate([prompt] * min(num_seqs, self.config.max_num_seqs),
                      SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return time.perf_counter() - start

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.allocator.num_free,
            num_total_blocks=self.allocator.num_blocks,
            num_steps=self.num_steps,
        )

    def check_invariants(self) -> None:
        """Every KV block is free xor owned by exactly the requests that list it."""
        self.allocator.check_invariants(self.scheduler.owners())

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every prompt to completion; returns the final outputs in input order (a prompt with
        n > 1 contributes its n completions, in index order)."""
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        added: list[str] = []
        ids: list[str] = []  # one per completion: n of them for a prompt with n > 1
        try:
            for prompt, sp in zip(prompts, params_list, strict=True):
                added.append(self.add_request(prompt, sp))
                ids += [added[-1]] if sp.n == 1 else [f"{added[-1]}.{i}" for i in range(sp.n)]
        except ValueError:
            for request_id in added:  # all or nothing: no orphans left queued
                self.abort(request_id)
            raise
        pending = set(ids)
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while pending:
            if not self.has_unfinished():
                raise RuntimeError(f"requests {sorted(pending)} vanished without finishing")
            for out in self.step():
                if out.finished and out.request_id in pending:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [final[i] for i in ids]
