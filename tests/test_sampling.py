"""BatchedSampler: greedy, filters, the distribution it draws from, seeds, and no readback.

The filter tests use one hand-written row whose probabilities are known exactly, so the set of
tokens each of top-k / top-p / min-p keeps is worked out by hand; many draws from a fixed
generator must then land on exactly that set. Distribution tests compare 20000 draws with
softmax(logits / T) computed here in plain Python.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import READBACK_ROUTES, readbacks_counted

from nanoserve.params import SamplingParams
from nanoserve.sampling import BatchedSampler

GREEDY = SamplingParams(temperature=0.0)
SAMPLER = BatchedSampler()

# Probabilities by token id, shuffled so that rank order is not id order.
# Ranked: token 1 (0.5), 3 (0.2), 4 (0.15), 0 (0.1), 2 (0.05).
PROBS = [0.1, 0.5, 0.05, 0.2, 0.15]
LOGITS = [math.log(p) for p in PROBS]




def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draws(params: SamplingParams, n: int = 20000, logits: list[float] = LOGITS, seed: int = 0) -> torch.Tensor:
    """n draws from one row: the row repeated n times in one batch, noise from one seeded generator."""
    batch = torch.tensor([logits] * n, dtype=torch.float32)
    return SAMPLER.sample_batch_device(batch, [params] * n, None, gen(seed))


def softmax(logits: list[float], temperature: float = 1.0) -> list[float]:
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    exps = [math.exp(x - top) for x in scaled]
    return [e / sum(exps) for e in exps]


def assert_matches(tokens: torch.Tensor, probs: list[float]) -> None:
    """Each token's frequency is within 5 standard errors of its probability.

    A frequency over n draws has standard error sqrt(p(1-p)/n) (0.0035 at most for n=20000); a
    two-sided 5-sigma miss has probability 6e-7 per token, so with a handful of tokens a correct
    sampler essentially never fails, while any real bias above ~2% is caught. The generator is
    seeded, so the outcome is fixed anyway.
    """
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=len(probs)).tolist()
    assert len(counts) == len(probs)
    for token, (count, p) in enumerate(zip(counts, probs, strict=True)):
        tolerance = 5 * math.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(count / n - p) <= tolerance, (token, count / n, p, tolerance)


# ---- greedy ------------------------------------------------------------------------------------


def test_all_greedy_is_argmax_on_the_logits_device_without_softmax_or_gather(monkeypatch):
    logits = torch.randn(7, 50, generator=gen(1))
    expected = [max(range(50), key=lambda j, row=row: row[j]) for row in logits.tolist()]

    def forbidden(*args, **kwargs):
        raise AssertionError("the all-greedy path must be one argmax")

    monkeypatch.setattr(torch.Tensor, "__getitem__", forbidden)
    monkeypatch.setattr(torch, "softmax", forbidden)
    monkeypatch.setattr(torch.Tensor, "sort", forbidden)
    out = SAMPLER.sample_batch_device(logits, [GREEDY] * 7)
    monkeypatch.undo()
    assert out.dtype == torch.int64 and out.device == logits.device and out.shape == (7,)
    assert out.tolist() == expected


def test_top_k_1_equals_greedy():
    logits = torch.randn(200, 30, generator=gen(2))
    params = [SamplingParams(temperature=1.3, top_k=1)] * 200
    assert SAMPLER.sample_batch(logits, params, None, gen(3)) == logits.argmax(-1).tolist()


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = torch.randn(6, 40, generator=gen(4))
    params = [GREEDY, SamplingParams(), GREEDY, SamplingParams(top_p=0.5), SamplingParams(seed=1), GREEDY]
    generators = [None, None, None, None, gen(1), None]
    out = SAMPLER.sample_batch(logits, params, generators, gen(5))
    argmax = logits.argmax(-1).tolist()
    assert [out[i] for i in (0, 2, 5)] == [argmax[i] for i in (0, 2, 5)]


# ---- sample_batch is the device path plus one tolist -------------------------------------------


@pytest.mark.parametrize("kind", ["greedy", "mixed", "seeded"])
def test_sample_batch_equals_device_path_tolist(kind):
    logits = torch.randn(5, 64, generator=gen(6))
    params, generators = batch_of(kind)
    a = SAMPLER.sample_batch(logits, params, regen(generators), gen(7))
    b = SAMPLER.sample_batch_device(logits, params, regen(generators), gen(7))
    assert isinstance(a, list) and all(type(t) is int for t in a)
    assert a == b.tolist()


def batch_of(kind: str) -> tuple[list[SamplingParams], list[int | None]]:
    """Five rows of a kind; generators are given as seeds (None: unseeded)."""
    if kind == "greedy":
        return [GREEDY] * 5, [None] * 5
    if kind == "mixed":
        return [GREEDY, SamplingParams(top_p=0.9), GREEDY, SamplingParams(temperature=0.7, top_k=5),
                SamplingParams(min_p=0.1)], [None] * 5
    return [SamplingParams(seed=11), GREEDY, SamplingParams(top_p=0.8, seed=12), SamplingParams(),
            SamplingParams(temperature=2.0, seed=13)], [11, None, 12, None, 13]


def regen(seeds: list[int | None]) -> list[torch.Generator | None]:
    return [None if s is None else gen(s) for s in seeds]


@pytest.mark.parametrize("kind", ["greedy", "mixed", "seeded"])
def test_device_path_reads_nothing_back(kind):
    logits = torch.randn(5, 64, generator=gen(8))
    params, seeds = batch_of(kind)
    generators, default = regen(seeds), gen(9)
    with readbacks_counted(forbid=(*READBACK_ROUTES, "numpy", "cpu")):
        out = SAMPLER.sample_batch_device(logits, params, generators, default)
    assert out.dtype == torch.int64 and out.shape == (5,) and out.device == logits.device


# ---- filters keep exactly the hand-computed sets -----------------------------------------------


@pytest.mark.parametrize("params, kept", [
    (SamplingParams(), {0, 1, 2, 3, 4}),
    (SamplingParams(top_k=2), {1, 3}),
    (SamplingParams(top_k=4), {1, 3, 4, 0}),
    (SamplingParams(top_k=0), {0, 1, 2, 3, 4}),  # 0 and -1 mean no limit
    # top-p keeps a token when the mass ranked above it is below top_p.
    (SamplingParams(top_p=0.49), {1}),  # mass above token 3 is 0.5
    (SamplingParams(top_p=0.51), {1, 3}),
    (SamplingParams(top_p=0.69), {1, 3}),  # mass above token 4 is 0.7
    (SamplingParams(top_p=0.71), {1, 3, 4}),
    (SamplingParams(top_p=0.86), {1, 3, 4, 0}),  # mass above token 2 is 0.95
    (SamplingParams(top_p=0.96), {0, 1, 2, 3, 4}),
    # min-p keeps p >= min_p * 0.5.
    (SamplingParams(min_p=0.25), {1, 3, 4}),  # threshold 0.125: 0.15 stays, 0.1 goes
    (SamplingParams(min_p=0.15), {1, 3, 4, 0}),  # threshold 0.075
    (SamplingParams(min_p=0.5), {1}),  # threshold 0.25: 0.2 goes too
    (SamplingParams(min_p=1.0), {1}),
    # top-p reads what top-k left, renormalised: over {1, 3, 4} (mass 0.85) the mass above
    # token 4 is 0.7 / 0.85 = 0.82 >= 0.8, so it goes (over the full row it would be 0.7 < 0.8).
    (SamplingParams(top_k=3, top_p=0.8), {1, 3}),
    (SamplingParams(top_k=3, top_p=0.83), {1, 3, 4}),
    (SamplingParams(top_p=0.8), {1, 3, 4}),
    # Temperature first: at T=0.5 probs are p^2 / sum p^2 = [0.031, 0.769, 0.008, 0.123, 0.069];
    # the mass above token 4 is 0.892 >= 0.8.
    (SamplingParams(temperature=0.5, top_p=0.8), {1, 3}),
    (SamplingParams(top_k=2, min_p=0.5), {1}),  # min-p 0.25 drops 0.2 whatever top-k kept
])
def test_filters_keep_exactly_the_hand_computed_support(params, kept):
    tokens = draws(params)
    assert set(tokens.tolist()) == kept


@pytest.mark.parametrize("params, kept_probs", [
    (SamplingParams(top_p=0.71), {1: 0.5, 3: 0.2, 4: 0.15}),
    (SamplingParams(top_k=2), {1: 0.5, 3: 0.2}),
    (SamplingParams(min_p=0.15), {1: 0.5, 3: 0.2, 4: 0.15, 0: 0.1}),
])
def test_filtered_draws_follow_the_renormalised_distribution(params, kept_probs):
    total = sum(kept_probs.values())
    expected = [kept_probs.get(t, 0.0) / total for t in range(5)]
    assert_matches(draws(params), expected)


# ---- the distribution ----------------------------------------------------------------------------

ROW = [1.0, 0.0, -1.0, 2.0, 0.5, -0.5]


def test_draws_at_temperature_1_match_softmax():
    assert_matches(draws(SamplingParams(), logits=ROW), softmax(ROW))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_logits(temperature):
    tokens = draws(SamplingParams(temperature=temperature), logits=ROW, seed=1)
    assert_matches(tokens, softmax(ROW, temperature))
    # The check can tell temperatures apart: token 3's probability moves by far more than 5 sigma.
    shift = abs(softmax(ROW, temperature)[3] - softmax(ROW)[3])
    assert shift > 10 * 5 * math.sqrt(0.25 / 20000)


def test_unseeded_rows_follow_the_default_generator():
    logits = torch.randn(8, 100, generator=gen(10))
    params = [SamplingParams()] * 8
    a = SAMPLER.sample_batch(logits, params, None, gen(3))
    b = SAMPLER.sample_batch(logits, params, None, gen(3))
    c = SAMPLER.sample_batch(logits, params, None, gen(4))
    assert a == b and a != c


# ---- seeds ------------------------------------------------------------------------------------


def seeded_tokens(row: torch.Tensor, params: SamplingParams, seed: int, others: list[tuple], position: int,
                  steps: int = 20) -> list[int]:
    """The seeded row's tokens over `steps` calls, placed at `position` among `others`.

    others: (logits_row, params, seed or None) for the other rows of the batch.
    """
    own = gen(seed)
    other_gens = [None if s is None else gen(s) for _, _, s in others]
    default = gen(999)
    tokens = []
    for _ in range(steps):
        rows = [r for r, _, _ in others]
        plist = [p for _, p, _ in others]
        gens = list(other_gens)
        rows.insert(position, row)
        plist.insert(position, params)
        gens.insert(position, own)
        out = SAMPLER.sample_batch(torch.stack(rows), plist, gens, default)
        tokens.append(out[position])
    return tokens


@pytest.mark.parametrize("params", [SamplingParams(seed=42), SamplingParams(seed=42, temperature=0.8, top_p=0.9)])
def test_a_seeded_row_gives_the_same_tokens_whatever_the_batch(params):
    logits = torch.randn(5, 80, generator=gen(12))
    row = logits[0]
    alone = seeded_tokens(row, params, 42, [], 0)
    assert len(set(alone)) > 3  # the row really samples: a constant would prove nothing
    others = [
        (logits[1], SamplingParams(), None),  # unseeded, no filters
        (logits[2], GREEDY, None),
        (logits[3], SamplingParams(seed=7, top_k=5), 7),  # seeded, filtered
        (logits[4], SamplingParams(temperature=1.5, min_p=0.05), None),
    ]
    for position in (0, 2, 4):
        assert seeded_tokens(row, params, 42, others, position) == alone, position
    assert seeded_tokens(row, params, 42, others[:1], 1) == alone  # all rows sampled, one unseeded
    assert seeded_tokens(row, params, 43, [], 0) != alone  # another seed, other tokens
