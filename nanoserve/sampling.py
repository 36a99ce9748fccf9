"""BatchedSampler: one step's next tokens for every sampling row, kept on the device.

Greedy rows are an argmax. Sampled rows are temperature, then top-k / top-p / min-p filters on
one sort of the batch, then an exponential race (argmax of p / E with E ~ Exp(1)), which draws
from p exactly and lets a seeded row take its noise from its own generator, so its tokens do
not depend on what else is in the batch.

A row verifying a speculative draft d samples as any other row does, and the output stage keeps d
when the row's token equals it. That is rejection sampling for a proposal that puts all its mass
on d: d is kept with probability p(d), and otherwise the token is a draw from p without d,
renormalised, so each kept token is a draw from the target's p. The token does not depend on
whether its row verified a draft, so a seeded request's tokens are those it samples without
speculation, once the engine takes back the noise of the rows it discarded (`skip_noise`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nanoserve.params import SamplingParams


@dataclass
class RowHistory:
    """What penalties and min_tokens need to know of one row's request."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_token_ids: frozenset[int]  # EOS and stop tokens: masked while output < min_tokens


class BatchedSampler:
    def sample_batch_device(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None] | None = None,
        default_generator: torch.Generator | None = None,
        histories: list[RowHistory | None] | None = None,
    ) -> torch.Tensor:
        """Samples one token per row.

        Args:
            logits: [rows, V] float logits on the forward's device.
            params: one SamplingParams per row.
            generators: per-row generator (a seeded request's own) or None, on logits.device.
            default_generator: used for the noise of unseeded sampled rows.
            histories: per row, the request's tokens when its params need them (penalties,
                min_tokens), else None.
        Returns:
            [rows] int64 on logits.device; nothing is read back to the host.
        """
        if histories is not None and any(h is not None for h in histories):
            logits = apply_history(logits, params, histories)
        if all(p.temperature == 0.0 for p in params):
            return logits.argmax(dim=-1)  # the all-greedy fast path: no gather, no per-row work
        greedy = logits.argmax(dim=-1)  # [rows]
        sampled_rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
        rows = sampled_rows if len(sampled_rows) < len(params) else None
        sub = logits[sampled_rows] if rows is not None else logits  # [S, V]
        sub_params = [params[i] for i in sampled_rows]
        temps = torch.tensor([p.temperature for p in sub_params], dtype=sub.dtype, device=sub.device)
        probs = torch.softmax(sub / temps[:, None], dim=-1)  # [S, V]
        if any(p.has_filters for p in sub_params):
            probs = _filter(probs, sub_params)
        noise = torch.empty_like(probs)  # [S, V]
        row_gens = [generators[i] for i in sampled_rows] if generators else []
        if any(g is not None for g in row_gens):
            for j, g in enumerate(row_gens):  # a seeded row draws from its own stream only
                noise[j].exponential_(generator=g or default_generator)
        else:
            noise.exponential_(generator=default_generator)
        tokens = probs.div_(noise).argmax(dim=-1)  # [S]
        if rows is None:
            return tokens
        return greedy.index_copy(0, torch.tensor(sampled_rows, device=logits.device), tokens)

    def sample_batch(self, logits: torch.Tensor, params: list[SamplingParams],
                     generators: list[torch.Generator | None] | None = None,
                     default_generator: torch.Generator | None = None,
                     histories: list[RowHistory | None] | None = None) -> list[int]:
        """sample_batch_device plus one .tolist(): the two paths cannot drift."""
        return self.sample_batch_device(logits, params, generators, default_generator, histories).tolist()


def skip_noise(generator: torch.Generator, num_rows: int, vocab_size: int, dtype: torch.dtype) -> None:
    """Advances a seeded request's generator past the noise of `num_rows` of its rows, drawn as
    sample_batch_device draws a seeded row's (one Exp(1) row of vocab_size values in `dtype`)."""
    row = torch.empty(vocab_size, dtype=dtype, device=generator.device)  # [V]
    for _ in range(num_rows):
        row.exponential_(generator=generator)


def apply_history(logits: torch.Tensor, params: list[SamplingParams], histories: list[RowHistory | None]) -> torch.Tensor:
    """min_tokens masking and the three penalties, on a copy of logits [rows, V].

    repetition_penalty (HF and vLLM): a token seen in prompt or output has its logit divided by
    the penalty when positive, multiplied when negative. presence and frequency (OpenAI): a token
    seen c > 0 times in the output loses presence + frequency * c.
    """
    logits = logits.clone()
    device = logits.device
    for i, (p, h) in enumerate(zip(params, histories, strict=True)):
        if h is None:
            continue
        row = logits[i]  # [V], a view: edits land in logits
        if len(h.output_token_ids) < p.min_tokens and h.stop_token_ids:
            row[torch.tensor(sorted(h.stop_token_ids), device=device)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(h.prompt_token_ids) | set(h.output_token_ids)), device=device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and h.output_token_ids:
            counts = torch.bincount(torch.tensor(h.output_token_ids, device=device), minlength=row.shape[0])
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits


def _filter(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zeroes the probability of tokens that top-k, top-p or min-p rule out. probs [S, V]."""
    S, V = probs.shape
    device = probs.device
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [S, V]
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)  # [S, V] in sorted order
    ranks = torch.arange(V, device=device)[None, :]  # [1, V]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=device)[:, None]  # [S, 1]
    keep &= ranks < top_k
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=device)[:, None]  # [S, 1]
    # As in vLLM, top-p reads the distribution top-k left (renormalised). It keeps the smallest
    # prefix whose mass reaches top_p: a token stays if the mass ranked above it is < top_p.
    after_k = sorted_probs * keep
    after_k = after_k / after_k.sum(dim=-1, keepdim=True)
    keep &= (after_k.cumsum(dim=-1) - after_k) < top_p
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=device)[:, None]  # [S, 1]
    keep &= sorted_probs >= min_p * sorted_probs[:, :1]
    keep[:, 0] = True  # the most likely token always survives
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def packed_prompt_logprobs(logits: torch.Tensor, scored: list[tuple[Any, int, int]]) -> torch.Tensor:
    """Prompt logprobs of the scored rows' logits [S, V] (each (request, first position, count) of
    `scored` in turn, a row per position p scoring prompt token p + 1), packed per row as
    [that token's, k values, k ids] on the device, k the largest any of them asks for."""
    targets = torch.tensor([request.prompt_token_ids[p + 1] for request, first, count in scored
                            for p in range(first, first + count)], device=logits.device)
    k = max(request.params.prompt_logprobs for request, _, _ in scored)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [S, V]
    own = logprobs.gather(1, targets[:, None])  # [S, 1]
    if not k:
        return own
    top = logprobs.topk(k, dim=-1)
    return torch.cat([own, top.values, top.indices.float()], dim=1)  # [S, 1 + 2k]


def packed_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                    params: list[SamplingParams]) -> tuple[list[int], torch.Tensor] | None:
    """The model's own log-probabilities (before penalties and temperature, as vLLM reports them)
    of the sampled token and the top k, for the rows that ask: (those rows, [L, 1 + 2k] packed per
    row as [sampled, k values, k ids], on the device). None when no row asks."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    k = max(params[i].logprobs for i in rows)
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)  # [L, V]
    sampled = logprobs.gather(1, tokens[index][:, None])  # [L, 1]
    top = logprobs.topk(k, dim=-1)  # [L, k] values and ids
    return rows, torch.cat([sampled, top.values, top.indices.float()], dim=1)  # [L, 1 + 2k]
