"""Accuracy against a reference: how far a lower precision moves the model's next-token distributions.

The reference is float32 on the same weights. `teacher_forced_logits` runs nanoserve's own forward
over a fixed text (data/quantbench.txt), so every position is scored on the true prefix whatever the
candidate would have generated; `compare` turns two such runs into perplexities, top-1 agreement and
the mean KL divergence. `greedy_agreement` scores free-running greedy generations over a prompt set.

Dimension names: T positions, V vocabulary, Tq one chunk's tokens, L a chunk's context in slots.
Row t of a logits tensor predicts token t + 1, so the targets for logits[:-1] are token_ids[1:].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanoserve.inputs import TokenRun, lay_out
from nanoserve.model.kv_cache import KVCache
from nanoserve.model.llama import LlamaModel

BLOCK_SIZE = 16  # tokens per KV block; the blocks are 0 .. nb - 1 in order, so a token's slot is its position
COMPARE_ROWS = 256  # positions per float64 slice in compare: bounds its temporaries at 2 x 256 x V doubles


def teacher_forced_logits(model: LlamaModel, token_ids: Sequence[int], chunk: int = 512,
                          kv_dtype: torch.dtype | str | None = None) -> torch.Tensor:
    """The next-token logits at every position of token_ids: [T, V] float32 on the CPU, the K/V
    cached in kv_dtype (None: the model's dtype; a block kind "q8_0" or "q4_0" too; EngineConfig.kv_cache_dtype).

    The text is fed as one sequence in chunks of `chunk` tokens, the way chunked prefill feeds a long
    prompt: each chunk after the first attends to the cached K/V of everything before it. chunk=1
    feeds it as decode steps instead, one query a step (what a generating request runs, including
    the model's fused decode where it has one). The result holds T x V floats (1.5 GB for 7,700
    tokens of a 49k vocabulary).

    Raises:
        ValueError: token_ids empty or longer than the model's rope table, an id outside the
            vocabulary, or chunk < 1.
    """
    num_tokens = len(token_ids)  # T
    max_positions = model.cos.shape[0]
    if num_tokens == 0:
        raise ValueError("token_ids is empty: need at least 1 token")
    if num_tokens > max_positions:
        raise ValueError(f"len(token_ids)={num_tokens} exceeds the model's {max_positions} positions")
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    vocab_size = model.config.vocab_size
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    device = model.device
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    kv = KVCache(model.config, num_blocks, BLOCK_SIZE, kv_dtype or model.dtype, device)
    logits = torch.empty(num_tokens, vocab_size, dtype=torch.float32)  # [T, V]
    with torch.inference_mode():
        for start in range(0, num_tokens, chunk):
            end = min(start + chunk, num_tokens)
            # one sequence whose blocks are 0 .. in order (a slot is its position), every row scored;
            # laid out as a step's inputs are, the windowed layers' metadata included
            run = TokenRun(list(token_ids[start:end]), start, list(range(-(-end // BLOCK_SIZE))), scored=(0, end - start))
            inputs = lay_out([run], BLOCK_SIZE, device, sliding_window=model.config.sliding_window)
            logits[start:end] = model(inputs, kv).cpu()  # [Tq, V]
    return logits


@dataclass(frozen=True)
class AccuracyReport:
    """A candidate's next-token distributions against the reference's over the same positions."""

    perplexity_ref: float  # exp of the reference's mean negative log-likelihood of the targets
    perplexity: float  # the same for the candidate
    perplexity_change: float  # perplexity / perplexity_ref - 1: 0.02 is 2% worse
    top1_agreement: float  # fraction of positions whose argmax token is the same in both
    mean_kl: float  # mean over positions of KL(reference || candidate), nats
    positions: int  # T, the number of positions scored


def compare(reference_logits: torch.Tensor, candidate_logits: torch.Tensor, targets: torch.Tensor) -> AccuracyReport:
    """Scores candidate_logits [T, V] against reference_logits [T, V] on targets [T] (int token ids).

    Softmax, log-likelihoods and KL are computed with log_softmax in float64.

    Raises:
        ValueError: logits not 2-D or of different shapes, T == 0, targets not of shape [T], or a
            target outside [0, V).
    """
    ref_shape, cand_shape = tuple(reference_logits.shape), tuple(candidate_logits.shape)
    if reference_logits.dim() != 2 or ref_shape != cand_shape:
        raise ValueError(f"reference_logits {list(ref_shape)} and candidate_logits {list(cand_shape)} "
                         "must both be [T, V]")
    T, V = ref_shape
    if T == 0:
        raise ValueError("logits have 0 positions: need at least 1")
    if tuple(targets.shape) != (T,):
        raise ValueError(f"targets {list(targets.shape)} must be [{T}] to match logits {list(ref_shape)}")
    targets = targets.to(torch.int64).cpu()
    if int(targets.min()) < 0 or int(targets.max()) >= V:
        raise ValueError(f"targets range over [{int(targets.min())}, {int(targets.max())}], outside [0, {V})")
    nll_ref = nll = kl = 0.0
    agree = 0
    for start in range(0, T, COMPARE_ROWS):
        rows = slice(start, start + COMPARE_ROWS)
        ref = reference_logits[rows].cpu().double()  # [r, V]
        cand = candidate_logits[rows].cpu().double()  # [r, V]
        logp_ref = torch.log_softmax(ref, dim=-1)  # [r, V]
        logp = torch.log_softmax(cand, dim=-1)  # [r, V]
        picked = targets[rows, None]  # [r, 1]
        nll_ref -= float(logp_ref.gather(1, picked).sum())
        nll -= float(logp.gather(1, picked).sum())
        kl += float((logp_ref.exp() * (logp_ref - logp)).sum())
        agree += int((ref.argmax(dim=-1) == cand.argmax(dim=-1)).sum())
    perplexity_ref, perplexity = math.exp(nll_ref / T), math.exp(nll / T)
    change = perplexity / perplexity_ref - 1
    return AccuracyReport(perplexity_ref, perplexity, change, agree / T, kl / T, T)


def worse_than(report: AccuracyReport, limit: float = 0.02) -> bool:
    """True when the candidate's perplexity is more than `limit` above the reference's (0.02 = 2% worse).

    Raises:
        ValueError: limit negative or not finite.
    """
    if not (limit >= 0 and math.isfinite(limit)):
        raise ValueError(f"limit={limit} must be finite and >= 0")
    return report.perplexity_change > limit


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b, strict=False):  # the shorter one ends the prefix
        if x != y:
            break
        n += 1
    return n


def greedy_agreement(ref_runs: Sequence[Sequence[int]], cand_runs: Sequence[Sequence[int]]) -> dict[str, float]:
    """Greedy generations over one prompt set, run i of each from prompt i.

    Returns:
        {"prompts": number of prompts, "mean_common_prefix": mean tokens generated before the first
        difference, "full_match": fraction of prompts whose generations are identical}.

    Raises:
        ValueError: no runs, or different numbers of runs.
    """
    if len(ref_runs) != len(cand_runs):
        raise ValueError(f"ref_runs has {len(ref_runs)} runs and cand_runs {len(cand_runs)}: "
                         "need one of each per prompt")
    if not ref_runs:
        raise ValueError("no runs: need at least 1 prompt")
    pairs = list(zip(ref_runs, cand_runs, strict=True))
    prefixes = [common_prefix(r, c) for r, c in pairs]
    full = sum(list(r) == list(c) for r, c in pairs)
    n = len(ref_runs)
    return {"prompts": n, "mean_common_prefix": sum(prefixes) / n, "full_match": full / n}
