"""Engine: the step loop and the public methods. The only room that knows every other room."""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from nanoserve.blocks import BlockAllocator
from nanoserve.chat import as_conversations, encode_chat, render_chat
from nanoserve.config import EngineConfig
from nanoserve.detokenize import IncrementalDetokenizer
from nanoserve.draft import DraftModel, load_draft
from nanoserve.inputs import TokenRun, build_inputs, lay_out, pooling_rows, prompt_scoring
from nanoserve.model.kv_cache import KVCache, bytes_per_block
from nanoserve.model.llama import LlamaModel
from nanoserve.model.plan import check_laid_out, resolve_plan, with_draft
from nanoserve.model.precision import KV_DTYPES
from nanoserve.model.prepare import prepare_model, weight_bytes
from nanoserve.output_processor import OutputProcessor, make_output
from nanoserve.parallel import TensorParallelModel, WorkerFailure, load_tensor_parallel, start
from nanoserve.params import PoolingParams, SamplingParams
from nanoserve.pooling import DEFAULT_POOLING, checkpoint_pooling
from nanoserve.readback import TokenBatch
from nanoserve.reasoning import ReasoningGrammar
from nanoserve.recorder import NULL_RECORDER
from nanoserve.request import (
    EMBEDDING_PARAMS,
    FinishReason,
    Request,
    RequestOutput,
    check_request,
    prompt_token_ids,
)
from nanoserve.sampling import BatchedSampler, RowHistory, packed_logprobs, packed_prompt_logprobs
from nanoserve.scheduler import Scheduler, SchedulerOutput
from nanoserve.speculator import Speculator
from nanoserve.step_rows import StepRows
from nanoserve.structured import GrammarCompiler, apply_bitmask

logger = logging.getLogger("nanoserve")


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
        model: a LlamaModel on config.device, as loaded: the engine runs a copy laid out in the
            execution plan `config` resolves to (Engine.plan). With
            config.tensor_parallel_size > 1, rank 0's TensorParallelModel, as Engine.from_pretrained
            loads it: the engine then starts the workers' step loops, and close() ends them.
        tokenizer: a Hugging Face tokenizer, or None (then prompts must be token ids and text is "").
        config: the EngineConfig.
        pooling: what `embed` pools when asked for nothing else (from_pretrained reads the
            checkpoint's: nanoserve.pooling); None: "last", normalised.
    Raises:
        ValueError: when config.max_model_len exceeds what the model can position, the model's
            device differs from the config's, a quantization has no kernels on the device, or
            config.tensor_parallel_size does not match the model's group.
        WorkerFailure: a tensor-parallel worker failed to lay its shard out.
    """

    def __init__(self, model: LlamaModel, tokenizer: Any = None, config: EngineConfig | None = None,
                 pooling: PoolingParams | None = None) -> None:
        config = config or EngineConfig()
        self.tokenizer, self.config = tokenizer, config
        self.pooling = pooling or DEFAULT_POOLING
        self.device = torch.device(config.device)
        if model.device.type != self.device.type:
            raise ValueError(f"the model is on {model.device}, the config asks for device={config.device!r}")
        world_size = model.group.world_size if isinstance(model, TensorParallelModel) else 1
        if world_size != config.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} but the model is split over {world_size} "
                             "process(es): a tensor-parallel engine is built by Engine.from_pretrained(path, config)")
        spec = config.speculative_config
        num_positions = model.cos.shape[0]
        self.max_model_len = config.max_model_len or num_positions
        if self.max_model_len > num_positions:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's {num_positions} positions")
        # How every step runs is decided once (dtype and quantization "auto" by a probe), the model
        # (and a draft model) laid out as the plan says (a new model: the one given is left as it
        # was) and held to it. The draft (method "draft_model") is loaded once the target's plan
        # allows speculation, and checked against the target.
        self.plan = resolve_plan(config, model, world_size)
        draft = (load_draft(spec.model, self.device, model, tokenizer, self.max_model_len)
                 if spec is not None and spec.method == "draft_model" else None)
        if draft is not None:
            self.plan = with_draft(self.plan, config, draft)
        # Speculation reads each step's tokens to propose the next step's drafts: nothing is deferred.
        self.deferred = config.deferred_output and spec is None
        logger.info("nanoserve: execution plan\n%s", self.plan.render())
        model = self.model = prepare_model(model, self.plan)
        draft = prepare_model(draft, self.plan.draft) if draft is not None else None
        mismatches = check_laid_out(model, self.plan, draft)
        if mismatches:
            raise RuntimeError(f"the laid-out model differs from its execution plan: {mismatches[:4]}")
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens={config.max_num_batched_tokens} is below max_model_len="
                             f"{self.max_model_len}: without chunked prefill a long prompt could never be scheduled")
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        kv_dtype = KV_DTYPES[self.plan.kv_cache_dtype]
        num_blocks = config.num_kv_blocks or max(
            1, config.kv_cache_memory_bytes // bytes_per_block(model.config, config.block_size, kv_dtype)
        )
        self.kv = KVCache(model.config, num_blocks, config.block_size, kv_dtype, self.device)
        if isinstance(model, TensorParallelModel):  # each worker lays its shard out alike, with as many blocks
            start(model, self.plan, num_blocks, config.block_size)
        self.allocator = BlockAllocator(num_blocks)
        self.scheduler = Scheduler(self.allocator, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_chunked_prefill,
                                   config.enable_prefix_caching)
        self.sampler = BatchedSampler()
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size, self.eos_token_ids)
        self.output = OutputProcessor()
        self.recorder = NULL_RECORDER
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self._generators: dict[str, torch.Generator] = {}  # seeded requests' own noise
        self._default_generator = torch.Generator(self.device).manual_seed(config.seed)
        self._ids = itertools.count()
        # Deferred mode: the batch sampled last step, not yet brought home, and its rows.
        self._in_flight: tuple[TokenBatch, StepRows] | None = None
        self._step_requests: list[Request] | None = None  # the running step's, once scheduled: fail_step's to abort
        self.num_steps = 0
        self.speculation = None  # speculative decoding's state from phase to phase (nanoserve.speculator)
        if spec is not None:
            draft_model = None if draft is None else DraftModel(draft, num_blocks, config.block_size,
                                                                KV_DTYPES[self.plan.draft.kv_cache_dtype], self.device,
                                                                config.decode_group_min_rows)
            self.speculation = Speculator(spec, draft_model)
            self.speculation.calibrate(lambda rows, draft: self.forward_seconds(rows, draft=draft))

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, config: EngineConfig | None = None) -> Engine:
        """Loads a Hugging Face Llama-family checkpoint directory, or a GGUF file (or a directory
        holding one and no config.json), served as it is stored; None serves the embedded default
        model from its own GGUF file. With config.tensor_parallel_size > 1 it starts the workers
        (or joins torchrun's ranks) and every rank reads only its own slices of the checkpoint."""
        from nanoserve.model.weights import checkpoint_source, load_checkpoint, return_freed_memory

        config = config or EngineConfig()
        pooling = checkpoint_pooling(*checkpoint_source(path))
        if config.tensor_parallel_size > 1:
            model, tokenizer = load_tensor_parallel(path, config)
        else:
            model, tokenizer = load_checkpoint(path, config.device, max_positions=config.max_model_len)
        try:
            engine = cls(model, tokenizer, config, pooling)
        except BaseException:
            if isinstance(model, TensorParallelModel):
                model.group.close()
            raise
        del model  # the stored form: what the engine's layout did not keep is garbage now
        return_freed_memory()
        return engine

    # ---- requests in -------------------------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Validates and queues one request; returns its id. With PoolingParams it is an embedding
        request: it forwards its prompt beside the others, samples nothing, and finishes with its
        vector (RequestOutput.embedding) in the step its last prompt rows come home.

        Raises:
            ValueError: empty prompt, token id outside the vocabulary, prompt plus max_tokens over
                max_model_len, a request the whole KV pool could not hold, a duplicate id,
                structured outputs that do not compile (compiled here, in the caller's thread), or
                an embedding request on a tensor-parallel engine or with dimensions over the
                model's hidden size.
        """
        pooling = params if isinstance(params, PoolingParams) else None
        params = EMBEDDING_PARAMS if pooling is not None else params or SamplingParams()
        if pooling is not None:
            self._check_pooling(pooling)
        token_ids = prompt_token_ids(prompt, self.tokenizer)
        check_request(token_ids, params, has_tokenizer=self.tokenizer is not None,
                      vocab_size=self.model.config.vocab_size, max_model_len=self.max_model_len,
                      block_size=self.config.block_size, num_blocks=self.allocator.num_blocks,
                      is_embedding=pooling is not None)
        if request_id is None:
            request_id = str(next(self._ids))
            while self._in_use(request_id, params.n):  # a caller may have chosen the next number already
                request_id = str(next(self._ids))
        elif self._in_use(request_id, params.n):
            raise ValueError(f"request_id {request_id!r} is already in use")
        structured = params.structured_outputs
        compiled = self.grammars.compile(structured) if structured is not None else None
        copies = self.scheduler.add(Request(request_id, token_ids, params, self.eos_token_ids, arrival_time, pooling))
        for request in copies:
            if compiled is not None:
                request.grammar = self.grammars.matcher(compiled)  # each copy walks the grammar alone
            if params.has_reasoning_gate:  # the grammar waits for the think block's end; a budget may force it
                request.grammar = ReasoningGrammar(params, token_ids, request.grammar)
            if self.tokenizer is not None:
                request.detokenizer = IncrementalDetokenizer(self.tokenizer)
            if request.params.seed is not None:
                self._generators[request.request_id] = torch.Generator(self.device).manual_seed(request.params.seed)
            self.requests[request.request_id] = request
        return request_id

    def _check_pooling(self, pooling: PoolingParams) -> None:
        if isinstance(self.model, TensorParallelModel):
            raise ValueError(f"embedding requests (PoolingParams) are not served with tensor_parallel_size="
                             f"{self.config.tensor_parallel_size}: serve the model with tensor_parallel_size=1")
        hidden = self.model.config.hidden_size
        if pooling.dimensions is not None and pooling.dimensions > hidden:
            raise ValueError(f"dimensions={pooling.dimensions} exceeds the model's hidden size {hidden}")

    def embed(self, prompts: str | Sequence[str | Sequence[int]], pooling: str | None = None,
              normalize: bool | None = None, dimensions: int | None = None,
              use_tqdm: bool = False) -> list[RequestOutput]:
        """Embeds every prompt (vLLM's `LLM.embed`): one finished output each, in input order,
        whose `embedding` is the vector (a list of floats) and `prompt_token_ids` the tokens it
        pooled. A single str is one prompt.

        Args:
            pooling: "last", "mean" or "cls" (PoolingParams); None: the engine's (`self.pooling`,
                the checkpoint's own where from_pretrained found one).
            normalize: L2-normalise the vector; None: as the engine's pooling does.
            dimensions: keep the first `dimensions` values, normalised again (needs normalize).
        Raises:
            ValueError: whatever PoolingParams or add_request refuses (then no prompt is left queued).
        """
        default = self.pooling
        params = PoolingParams(pooling or default.pooling, default.normalize if normalize is None else normalize,
                               dimensions)
        return self.generate(prompts, [params] * (1 if isinstance(prompts, str) else len(prompts)), use_tqdm)

    def _in_use(self, request_id: str, n: int) -> bool:
        ids = [request_id] if n == 1 else [f"{request_id}.{i}" for i in range(n)]
        return request_id in self.scheduler.groups or any(i in self.requests for i in ids)

    def is_unfinished(self, request_id: str) -> bool:
        """Whether `request_id` (an id add_request returned, or one copy's of an n > 1 group) has
        anything left to finish."""
        return request_id in self.requests or request_id in self.scheduler.groups

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stops a request, or every unfinished copy of an n > 1 group, and returns their blocks to
        the pool. Returns the final output of each completion aborted (in index order for a group).

        Raises:
            ValueError: the id is not an unfinished request or group of this engine.
        """
        copies = self.scheduler.groups.get(request_id)
        if copies is not None:
            return [self._abort_one(self.requests[c]) for c in list(copies) if c in self.requests]
        request = self.requests.get(request_id)
        if request is None:
            raise ValueError(f"request_id {request_id!r} is not an unfinished request")
        return [self._abort_one(request)]

    def _abort_one(self, request: Request) -> RequestOutput:
        request.finish(FinishReason.ABORT, time.perf_counter())
        self._retire(request)
        return make_output(request)

    def _retire(self, request: Request) -> None:
        """Forgets a finished request: its blocks and slot go back to the scheduler."""
        self.scheduler.finish(request)
        del self.requests[request.request_id]
        self._generators.pop(request.request_id, None)
        request.grammar = None

    # ---- the step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Runs one iteration: schedule, sync_rows, build_inputs, forward, sample, collect; with
        speculative decoding, propose before schedule and, for a draft model, draft after it; with
        structured outputs, grammar_mask before sample.

        Returns the outputs of the requests that received a token (or finished) in this step's
        collect. With config.deferred_output, collect resolves the *previous* step's tokens after
        this step's forward was launched, so the readback never idles the device; the next
        decode's input ids come from the device tensor, and a stop found one step late discards
        its one token of overshoot.
        """
        rec, spec = self.recorder, self.speculation
        deferred = self.deferred
        started = time.perf_counter()
        rec.begin_step()
        self._step_requests = None
        if spec is not None:
            with rec.phase("propose"):
                spec.propose(self.scheduler.running)
        with rec.phase("schedule"):
            sched = self.scheduler.schedule()
        if spec is not None and spec.needs_drafts(sched):
            with rec.phase("draft", syncs=True):
                spec.make_drafts(sched, self.scheduler, self.model.config.vocab_size, self.grammars)
        in_flight = self._in_flight[1].spans if self._in_flight else ()
        homing = [span.request for span in in_flight if not span.request.is_finished]  # not overshoot
        if self._in_flight and self._in_flight[0].pooled:  # embeddings whose last rows are on their way home
            homing += [request for request, _, _ in self._in_flight[0].pooled[0] if not request.is_finished]
        self._step_requests = [item.request for item in sched.scheduled] + homing
        if sched.is_empty:  # idle: what is left in flight comes home after the step, ending the loop
            rec.end_step(num_rows=0, num_tokens=0, num_decode_rows=0)
            in_flight, self._in_flight = self._in_flight, None
            return self._resolve(*in_flight) if in_flight is not None else []
        # Deferred mode brings last step's tokens home before this step's rows are fixed when a row's
        # penalties or min_tokens must see its whole history, or its grammar must take the token
        # before it can say what may follow; a request that finishes then drops out.
        flush = any(span.request.params.needs_resolved_output for span in in_flight)
        with rec.phase("sync_rows", syncs=flush):
            outputs = self._resolve(*self._in_flight) if flush else []
            if flush:
                self._in_flight = None
                sched = sched.without_finished()
            rows = StepRows.of(sched.scheduled)  # the logits' rows: each sampling request's, and its drafts'
            pending = self._in_flight
        if sched.is_empty:  # every scheduled request finished in the flush
            rec.end_step(num_rows=0, num_tokens=0, num_decode_rows=0)
            return outputs
        with rec.phase("build_inputs"):
            inputs = build_inputs(sched, self.config.block_size, self.device, pending and pending[0],
                                  self.config.decode_group_min_rows, self.model.config.sliding_window)
        with rec.phase("forward"):
            logits = self.model.forward(inputs, self.kv)  # [rows, V], then the prompt-logprob rows'
        pooled = None
        if inputs.pooled_indices is not None:  # embedding requests' rows came back beside the logits, normed
            logits, hidden = logits
            pooled = self._pool(sched, hidden)
        prompt = None
        if logits.shape[0] > rows.num_rows:  # rows scoring prompt tokens follow the sampling rows
            scored = [(item.request, *prompt_scoring(item)) for item in sched.scheduled]
            scored = [run for run in scored if run[2]]
            prompt = scored, packed_prompt_logprobs(logits[rows.num_rows:], scored)
            logits = logits[:rows.num_rows]
        bitmask = None
        if any(span.request.grammar is not None for span in rows.spans):  # host work after the launch: on a GPU it overlaps the forward
            with rec.phase("grammar_mask"):
                bitmask = self.grammars.fill_bitmask(rows)  # [rows, ceil(V / 32)]
        with rec.phase("sample"):
            batch = self._sample(logits, rows, bitmask, prompt, pooled)
        with rec.phase("collect", syncs=not deferred):
            sampled = (batch, rows)
            if deferred:
                sampled, self._in_flight = pending, sampled
            outputs += self._collect(sched, sampled)
        self.num_steps += 1
        num_drafted = sum(len(item.draft_token_ids) for item in sched.scheduled)
        num_decode_rows = sum(item.num_new_tokens for item in sched.scheduled
                              if item.num_new_tokens == 1 + len(item.draft_token_ids))
        num_accepted = 0
        if spec is not None:
            spec.end_step(len(sched.scheduled), num_decode_rows == sched.num_batched_tokens, num_drafted > 0,
                          time.perf_counter() - started)
            num_accepted = spec.num_accepted
        rec.end_step(num_rows=rows.num_rows, num_tokens=sched.num_batched_tokens, num_decode_rows=num_decode_rows,
                     num_draft_tokens=num_drafted, num_accepted_tokens=num_accepted)
        return outputs

    def forward_seconds(self, num_rows: int, context: int = 128, repeats: int = 5, draft: bool = False) -> float:
        """Seconds of one forward of a lone sequence scoring `num_rows` tokens after `context` cached
        ones (median of `repeats`, after one warm-up), by the target or (draft=True) the draft model:
        the start-up timing speculation's cost model is fitted to (Speculator.calibrate). Writes
        garbage K/V into free blocks, which it returns to the pool."""
        drafter = self.speculation.draft if draft else None
        model, kv = (drafter.model, drafter.kv) if drafter is not None else (self.model, self.kv)
        bs = self.config.block_size
        context = max(0, min(context, self.allocator.num_free * bs - num_rows))
        block_ids = self.allocator.allocate(-(-(context + num_rows) // bs))
        try:
            inputs = lay_out([TokenRun([0] * num_rows, context, block_ids, 1)], bs, self.device, None,
                             self.config.decode_group_min_rows, self.model.config.sliding_window)
            times = []
            with torch.inference_mode():
                for _ in range(repeats + 1):
                    start = time.perf_counter()
                    model.forward(inputs, kv)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    times.append(time.perf_counter() - start)
        finally:
            self.allocator.free(block_ids)
        return statistics.median(times[1:])

    def fail_step(self, error: Exception) -> list[RequestOutput]:
        """After step() raised `error`: aborts the step's requests (those it scheduled and those whose
        deferred token it was bringing home, whole n > 1 groups) and returns their final outputs, so
        the engine goes on serving the others. A request the step finished before the fault keeps its
        own finish reason.

        Raises:
            RuntimeError: the engine must not step again: the fault was in schedule (the queues may be
                half-updated), on the device (it poisons later steps) or in a tensor-parallel worker
                (WorkerFailure: the group is broken), or the pool's invariants fail.
        """
        requests, self._step_requests = self._step_requests, None
        if requests is None or isinstance(error, (torch.AcceleratorError, WorkerFailure)):
            raise RuntimeError(f"a step fault the engine cannot recover from: {error!r}") from error
        self._in_flight = None  # its tokens belong to the requests aborted here
        outputs = [make_output(r) for r in dict.fromkeys(requests) if r.is_finished and r.request_id not in self.requests]
        for group_id in dict.fromkeys(r.parent_id or r.request_id for r in requests):
            outputs += self.abort(group_id) if self.is_unfinished(group_id) else []
        try:
            self.check_invariants()
        except AssertionError as e:
            raise RuntimeError(f"the block pool is inconsistent after a step fault ({e}): {error!r}") from error
        return outputs

    def _collect(self, sched: SchedulerOutput, sampled: tuple[TokenBatch, StepRows] | None) -> list[RequestOutput]:
        """Advances the counters of what this step forwarded, then brings one sampled step home:
        this step's, or in deferred mode the previous one's (None on the first step)."""
        self.scheduler.advance(sched)
        return self._resolve(*sampled) if sampled is not None else []

    def _resolve(self, batch: TokenBatch, rows: StepRows) -> list[RequestOutput]:
        """One readback through the output stage; the requests it finished leave the engine, and
        speculation rolls back what the step rejected."""
        result = self.output.process(batch, rows)
        for request in result.finished:
            self._retire(request)
        if self.speculation is not None:
            self.speculation.after_resolve(result, self.scheduler, self._generators)
        return result.outputs

    def _pool(self, sched: SchedulerOutput, hidden: torch.Tensor) -> tuple[list, torch.Tensor]:
        """Each scheduled embedding request's (request, rows pooled, prompt done) and the sum of its
        pooled rows of `hidden` [P, E] (its rows in order, as pooling_rows laid them out), [N, E]
        on the device; the positions pooled are marked done (num_pooled_tokens)."""
        runs, counts = [], []
        for item in sched.scheduled:
            found = pooling_rows(item)
            if found is None:
                continue
            request = item.request
            end = request.num_computed_tokens + item.num_new_tokens
            runs.append((request, found[1], end == request.num_prompt_tokens))
            counts.append(found[1])
            request.num_pooled_tokens = max(request.num_pooled_tokens, end)
        return runs, torch.stack([part.sum(dim=0) for part in hidden.split(counts)])  # [N, E]

    def _sample(self, logits: torch.Tensor, rows: StepRows, bitmask: torch.Tensor | None = None,
                prompt: tuple[list, torch.Tensor] | None = None,
                pooled: tuple[list, torch.Tensor] | None = None) -> TokenBatch:
        """Samples every row's next token, within its grammar where the bitmask says; the tokens
        stay on the device. Logprobs are the model's own, read before the mask. A row verifying a
        draft sees, as its history, the drafts before it on its request's earlier rows. `prompt`:
        the step's prompt logprobs, packed, and `pooled` its embedding sums (_pool), riding home
        with the tokens."""
        requests = rows.requests
        params = [r.params for r in requests]
        generators = [self._generators.get(r.request_id) for r in requests] if self._generators else None
        histories = None
        if any(p.needs_history for p in params):
            histories = [RowHistory(span.request.prompt_token_ids, span.request.output_token_ids + list(ahead),
                                    self.eos_token_ids | set(span.request.params.stop_token_ids))
                         if span.request.params.needs_history else None for span, ahead in rows.drafts_before()]
        masked = apply_bitmask(logits, bitmask) if bitmask is not None else logits
        if self.speculation is not None:
            self.speculation.before_sample(rows, self._generators, (masked.shape[-1], masked.dtype))
        tokens = self.sampler.sample_batch_device(masked, params, generators, self._default_generator, histories)
        if self.deferred:
            for r in requests:
                r.num_pending_tokens += 1  # sampled, not yet home: the scheduler may already decode it
        logprobs = packed_logprobs(logits, tokens, params)
        return TokenBatch(tokens, rows.request_ids, self.output.readback, logprobs, prompt, pooled)

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

    def close(self) -> None:
        """Ends a tensor-parallel engine's workers and waits for their processes (a process that
        does not end in time is killed); nothing to do in one process. Idempotent: `with
        Engine.from_pretrained(...) as engine:` calls it on the way out, exception or not."""
        if isinstance(self.model, TensorParallelModel):
            self.model.group.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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

    def memory(self) -> dict[str, int]:
        """Bytes held by the weights, by form (see prepare.weight_bytes), and by the KV pool."""
        held = weight_bytes(self.model) | {"kv_cache": self.kv.nbytes}
        draft = self.speculation.draft if self.speculation is not None else None
        if draft is not None:
            held |= {f"draft_{form}": n for form, n in weight_bytes(draft.model).items()}
            held["draft_kv_cache"] = draft.kv.nbytes
        return held

    def check_invariants(self) -> None:
        """Every KV block is free xor owned by exactly the requests that list it."""
        self.allocator.check_invariants(self.scheduler.owners())

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | PoolingParams | Sequence[SamplingParams | PoolingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every prompt to completion; returns the final outputs in input order (a prompt with
        n > 1 contributes its n completions, in index order). A single str is one prompt. A prompt
        with PoolingParams is embedded (see add_request), in the same steps as the others.

        Raises:
            ValueError: as many SamplingParams as prompts were not given, or whatever add_request
                refuses for any prompt (then none of them is left queued).
        """
        if isinstance(prompts, str):
            prompts = [prompts]  # not one prompt per character
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        added: list[str] = []
        ids: list[str] = []  # one per completion: n of them for a prompt with n > 1
        try:
            for prompt, sp in zip(prompts, params_list, strict=True):
                added.append(self.add_request(prompt, sp))
                n = sp.n if isinstance(sp, SamplingParams) else 1  # PoolingParams: an embedding, one output
                ids += [added[-1]] if n == 1 else [f"{added[-1]}.{i}" for i in range(n)]
        except ValueError:
            for request_id in added:  # all or nothing: no orphans left queued
                self.abort(request_id)
            raise
        pending = set(ids)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        while pending:
            if not self.has_unfinished():
                raise RuntimeError(f"requests {sorted(pending)} vanished without finishing")
            for out in self.step():
                if out.finished and out.request_id in pending:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
                    bar.update(1)
        bar.close()
        return [final[i] for i in ids]

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Runs one conversation, or a list of them, to completion (vLLM's `LLM.chat`): each is
        written out by the tokenizer's chat template with the assistant's turn opened, encoded with
        no special tokens added (the template wrote them), and run by generate.

        Args:
            messages: a conversation ({"role", "content"} dicts, oldest first) or a list of them.
            params: as for generate: one SamplingParams for every conversation, or one each.
            use_tqdm: a progress bar over the completions.
            chat_template_kwargs: arguments to the template (`add_generation_prompt`, `tools`,
                `continue_final_message`, a model's own switches).
        Returns:
            generate's outputs, in conversation order.
        Raises:
            ValueError: no tokenizer or no chat template, messages that are not conversations, a
                conversation the template rejected, or whatever generate refuses.
        """
        kwargs = chat_template_kwargs or {}
        prompts = [encode_chat(self.tokenizer, render_chat(self.tokenizer, conversation, **kwargs))
                   for conversation in as_conversations(messages)]
        return self.generate(prompts, params, use_tqdm)
