"""The draft model of speculative decoding (method "draft_model"): a smaller model with the target's
vocabulary proposes each drafting request's next k tokens, greedily, and the target verifies them
in its normal step (nanoserve.speculative has the verification).

The draft keeps its own paged K/V: a pool with as many blocks as the target's, indexed by the same
block ids. The scheduler's decisions (which blocks a request owns, what a rollback, a preemption
or a finish gives back) then hold for both models, and the draft needs no allocator of its own.
Drafts are made after schedule, when the blocks for their positions are the request's: the
scheduler budgets k placeholder rows, and `DraftModel.propose` writes the tokens into them.

A request's draft K/V covers its first `num_draft_computed` tokens. A verification that rejected
drafts leaves the draft's K/V of them behind, and a preemption frees the blocks, so each proposal
first cuts that count to the target's num_computed_tokens (preemption sets it to 0). The first of
the k forwards then catches the draft up on what the target computed since (the prompt, the tokens
of steps it did not draft, the tokens a verification kept) together with the last token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nanoserve.inputs import TokenRun, lay_out
from nanoserve.model.kv_cache import KVCache
from nanoserve.model.llama import LlamaModel
from nanoserve.scheduler import ScheduledRequest
from nanoserve.speculative import running_mean
from nanoserve.structured import apply_bitmask


@dataclass
class _Drafting:
    """One request's drafting: its tokens and the drafts made so far, and how many of them the
    draft's K/V holds."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    num_drafts: int  # drafts it may get: fewer when one is a stop token
    stops: frozenset[int]  # tokens that would end the request: no draft follows one
    grammar: Any  # the request's RequestGrammar, or None
    drafts: list[int] = field(default_factory=list)

    @property
    def is_done(self) -> bool:
        return len(self.drafts) == self.num_drafts or (bool(self.drafts) and self.drafts[-1] in self.stops)


def check_vocabulary(draft: LlamaModel, draft_tokenizer: Any, target: LlamaModel, target_tokenizer: Any) -> None:
    """Refuses a draft whose token ids do not mean the target's.

    Raises:
        ValueError: the vocabulary sizes differ, or both tokenizers are known and map some token
            to different ids.
    """
    size, target_size = draft.config.vocab_size, target.config.vocab_size
    if draft_tokenizer is not None and target_tokenizer is not None and hasattr(draft_tokenizer, "get_vocab") \
            and hasattr(target_tokenizer, "get_vocab"):
        vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
        if vocab != target_vocab:
            differ = sorted(set(vocab.items()) ^ set(target_vocab.items()), key=str)[:3]
            raise ValueError(f"speculative_config draft model's tokenizer ({len(vocab)} tokens) is not the target's "
                             f"({len(target_vocab)} tokens); they differ at {differ}")
    if size != target_size:
        raise ValueError(f"speculative_config draft model has vocab_size={size}, the target {target_size}: "
                         "a draft must share the target's vocabulary")


class DraftModel:
    """A draft model laid out for the engine's device, with its K/V pool beside the target's.

    Args:
        model: the draft, laid out (prepare_model) as its own execution plan says.
        num_blocks, block_size: the target pool's: the draft's pool has the same block ids.
        kv_dtype, device: the draft pool's element type (a torch dtype, or a block kind of
            nanoserve.model.kv_quant: the draft's plan takes the engine's kv_cache_dtype, so a
            q8_0 target drafts over a q8_0 pool) and device.
        decode_group_min_rows: build_inputs' split of decode rows (the engine's config).
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype | str,
                 device: torch.device, decode_group_min_rows: int | None) -> None:
        self.model = model
        self.block_size, self.device = block_size, device
        self.decode_group_min_rows = decode_group_min_rows
        self.kv = KVCache(model.config, num_blocks, block_size, kv_dtype, device)
        self.token_seconds: float | None = None  # running mean of a forward that drafts a token a request

    def propose(self, items: Sequence[ScheduledRequest], vocab_size: int, grammars: Any) -> float:
        """Writes each item's drafts over its placeholders: the draft's greedy continuation of the
        request's tokens, one forward per draft (every drafting request in each), within the
        request's grammar (`grammars`, the engine's GrammarCompiler, walks its matcher through the
        drafts). A request's drafts end at a stop token: fewer drafts than placeholders are left
        then, for the caller to drop. Token ids at or past the target's `vocab_size` (a draft's
        padded embedding) are never proposed.

        Returns the seconds the first forward spent catching up beyond what drafting one token a
        request costs (SpeculationRule measures steady drafting: a request that rested catches up
        on every token since, once)."""
        views = []
        for item in items:
            if not item.draft_token_ids:
                continue
            request, params = item.request, item.request.params
            request.num_draft_computed = min(request.num_draft_computed, request.num_computed_tokens)
            # A grammar ends at an end-of-sequence token whatever ignore_eos says (GrammarCompiler's stops).
            ends = not params.ignore_eos or params.structured_outputs is not None
            stops = frozenset(params.stop_token_ids) | (request.eos_token_ids if ends else frozenset())
            views.append(_Drafting(request.request_id, list(request.token_ids), request.num_draft_computed,
                                    request.block_ids, len(item.draft_token_ids), stops, request.grammar))
        active, catch_up_s = views, 0.0
        while active:
            started = time.perf_counter()
            runs = [TokenRun(v.token_ids[v.num_computed_tokens:], v.num_computed_tokens, v.block_ids, 1) for v in active]
            inputs = lay_out(runs, self.block_size, self.device, None, self.decode_group_min_rows,
                             self.model.config.sliding_window)
            logits = self.model.forward(inputs, self.kv)[:, :vocab_size]  # [len(active), V]
            if any(v.grammar is not None for v in active):
                logits = apply_bitmask(logits, self._bitmask(active, grammars))
            tokens = logits.argmax(-1).tolist()  # the host waits for the forward here
            seconds = time.perf_counter() - started
            if all(len(run.token_ids) == 1 for run in runs):  # a token a request: the steady cost
                self.token_seconds = running_mean(self.token_seconds, seconds)
            elif self.token_seconds is not None and max(len(run.token_ids) for run in runs) > 2:
                catch_up_s = max(0.0, seconds - self.token_seconds)
            for view, token in zip(active, tokens, strict=True):
                view.num_computed_tokens = len(view.token_ids)
                view.token_ids.append(token)
                view.drafts.append(token)
            active = [v for v in active if not v.is_done]
        proposed = {v.request_id: v for v in views}
        for item in items:
            view = proposed.get(item.request.request_id)
            if view is not None:
                item.draft_token_ids[:len(view.drafts)] = view.drafts
                item.request.num_draft_computed = view.num_computed_tokens
        return catch_up_s

    @staticmethod
    def _bitmask(views: list[_Drafting], grammars: Any) -> torch.Tensor:
        """[rows, W]: what each request's grammar allows after its drafts so far (all ones: no grammar)."""
        full = torch.full((1, grammars.bitmask_width), -1, dtype=torch.int32)
        return torch.cat([full if v.grammar is None else grammars.span_bitmask(v.grammar, v.drafts)[-1:]
                          for v in views])


def load_draft(path: str, device: torch.device, target: LlamaModel, target_tokenizer: Any,
               max_model_len: int) -> LlamaModel:
    """The draft model at `path` (a checkpoint directory or a .gguf file), as stored, checked against
    the target; the engine's execution plan lays it out (ExecutionPlan.draft).

    Raises:
        ValueError: a draft whose vocabulary is not the target's (check_vocabulary), or that cannot
            position max_model_len tokens.
    """
    from nanoserve.model.weights import checkpoint_source, load_stored, load_tokenizer

    source, is_gguf = checkpoint_source(path)
    model = load_stored(source, is_gguf, device, max_model_len)
    has_tokenizer = is_gguf or any((source / name).exists()
                                   for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    check_vocabulary(model, load_tokenizer(source, is_gguf) if has_tokenizer else None, target, target_tokenizer)
    if model.cos.shape[0] < max_model_len:
        raise ValueError(f"speculative_config draft model positions {model.cos.shape[0]} tokens, "
                         f"under the engine's max_model_len={max_model_len}")
    return model
