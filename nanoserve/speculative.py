"""Speculative decoding: proposals for a request's next tokens, scored by the target in one step.

A request whose last token is home may carry up to k draft tokens into the next step. The
scheduler forwards its last token and the drafts as 1 + k query rows over its paged K/V, beside
every other request's rows, and every one of those rows samples: row j's token is what the target
says follows the last token and drafts 0 .. j-1. A draft is kept while it equals what its row
sampled (for a sampled row that is the rejection test: see nanoserve.sampling), and the first row
that disagrees gives the step's last token, so a step yields 1 .. k + 1 tokens. The rows past the
first rejected draft were computed in vain: Scheduler.rollback moves num_computed_tokens back over
them and returns the blocks that held nothing else.

Exact under greedy only where a row's logits do not depend on how many rows the step had: the
engine asks for the batch-invariant plan (nanoserve.model.plan) and refuses speculation where it
cannot have it.

The proposer here is plain Python over the request's own tokens (`NgramProposer`, vLLM's
"ngram": prompt lookup); a draft model's (nanoserve.draft) runs after schedule, over placeholder
drafts the rule hands out. `SpeculationRule` decides, each step, which requests may speculate at
all, so speculation does not cost where its proposals seldom hit.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from os import PathLike, fspath
from typing import Any

METHODS = ("ngram", "draft_model")
PLACEHOLDER = -1  # a draft the scheduler budgets before the draft model has made it
MEASURE_WEIGHT = 0.25  # SpeculationRule's running means of step time: the weight of each new step
PROBE_SHARE = 0.02  # the most of the decode time since the last drafting step a probe's catch-up may take


@dataclass(frozen=True)
class SpeculativeConfig:
    """EngineConfig.speculative_config, with vLLM's names. Build it from a dict with `parse`.

    method: "ngram" (proposals from the request's own prompt and output) or "draft_model" (a smaller
    model with the target's vocabulary, at `model`: a checkpoint directory or a .gguf file, laid out
    as the engine's config says but for its own `quantization`, EngineConfig's choices, "auto" by
    default: a GGUF draft kept as stored beside a dense target; nanoserve.draft).
    num_speculative_tokens: k, the drafts a request may carry into a step.
    prompt_lookup_max / prompt_lookup_min: the longest and shortest suffix of the request's tokens
    that ngram looks up earlier in them (either alone sets both; neither: 5 and 5, vLLM's default).
    overhead_rows: what a step costs before its rows, in rows (a / b for a step of R rows costing
    a + b R), or "auto": timed at start-up (Engine.forward_seconds). A request proposes while its
    recent acceptance (accepted / drafted, halved toward each new verification's) is at least
    R / (R + overhead_rows), R the step's rows so far; below that its drafts would cost more than the
    tokens they save (SpeculationRule). It probes again every `probe_every` steps.
    min_acceptance: a fixed floor in place of that rule (0: a request always proposes); None: the rule.
    max_step_rows: drafts are handed out, oldest request first, only while the step's sampled rows
    stay within this many; None: no limit but the rule's.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    quantization: str | None = "auto"
    overhead_rows: float | str = "auto"
    min_acceptance: float | None = None
    probe_every: int = 16
    max_step_rows: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is not one of {list(METHODS)}")
        if self.method == "draft_model" and not isinstance(self.model, str | PathLike):
            raise ValueError(f"speculative_config method='draft_model' needs model=PATH (a checkpoint directory "
                             f"or a .gguf file), got model={self.model!r}")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config model={self.model!r}: only method='draft_model' takes a model")
        if self.method != "draft_model" and self.quantization != "auto":
            raise ValueError(f"speculative_config quantization={self.quantization!r}: only method='draft_model' "
                             "has a model to quantize")
        if self.method != "ngram" and (self.prompt_lookup_min is not None or self.prompt_lookup_max is not None):
            raise ValueError("speculative_config prompt_lookup_min / prompt_lookup_max belong to method='ngram'")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens={k!r} must be an integer >= 1")
        if self.model is not None:
            object.__setattr__(self, "model", fspath(self.model))
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name}={value!r} must be an integer >= 1")
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min={lo} exceeds prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if self.min_acceptance is not None and (not isinstance(self.min_acceptance, int | float)
                                                or not 0.0 <= self.min_acceptance <= 1.0):
            raise ValueError(f"speculative_config min_acceptance={self.min_acceptance!r} must be None or in [0, 1]")
        if self.overhead_rows != "auto" and (isinstance(self.overhead_rows, bool)
                                             or not isinstance(self.overhead_rows, int | float)
                                             or not self.overhead_rows >= 0.0):
            raise ValueError(f"speculative_config overhead_rows={self.overhead_rows!r} must be 'auto' or a number >= 0")
        if not isinstance(self.probe_every, int) or self.probe_every < 1:
            raise ValueError(f"speculative_config probe_every={self.probe_every!r} must be an integer >= 1")
        if self.max_step_rows is not None and (not isinstance(self.max_step_rows, int) or self.max_step_rows < 2):
            raise ValueError(f"speculative_config max_step_rows={self.max_step_rows!r} must be None or an integer >= 2")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any]) -> SpeculativeConfig:
        """A SpeculativeConfig from itself or from vLLM's dict spelling.

        Raises:
            ValueError: not a mapping, a key this config does not know (named), or a bad value.
        """
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict or SpeculativeConfig, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**value)


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the request's last n
    tokens, for n from prompt_lookup_max down to prompt_lookup_min (the longest match wins).

    The search runs over the token ids as bytes (`bytes.rfind`, four bytes a token), so a step costs
    a C-speed scan of each proposing request's tokens.
    """

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens to follow `token_ids`; [] when no suffix of lookup_min .. lookup_max
        tokens occurs earlier in them."""
        n_tokens = len(token_ids)
        if k < 1 or n_tokens < self.lookup_min + 1:
            return []
        data = array("i", token_ids).tobytes()
        for n in range(min(self.lookup_max, n_tokens - 1), self.lookup_min - 1, -1):
            suffix = data[4 * (n_tokens - n):]
            end = 4 * (n_tokens - 1)  # an occurrence must end before the last token: not the suffix itself
            while True:
                at = data.rfind(suffix, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:  # aligned: a match of whole tokens
                    # What followed it, continued past the last token by what it proposes: a pattern
                    # of period p (the latest occurrence is p back) gives k drafts, not p.
                    start, drafts = at // 4 + n, []
                    for i in range(start, start + k):
                        drafts.append(token_ids[i] if i < n_tokens else drafts[i - n_tokens])
                    return drafts
                end = at + 4 * n - 1  # a match across token boundaries: look further left
        return []


class SpeculationRule:
    """Which requests propose this step, and how many drafts each may carry.

    A draft row costs real compute: a step of R rows costs about a + b R (a: what it costs before
    its rows, reading the weights once, the per-step work; b: a row), and a request that drafts
    gains only the drafts kept. Adding one request's k drafts, kept at a rate alpha, to a step of R
    rows raises the step's tokens per second iff (R + alpha k) / (a + b (R + k)) > R / (a + b R), that
    is iff alpha > R / (R + a / b), whatever k; a draft model that spends d on each draft token moves
    this to alpha > R (1 + d / b) / (R + a / b) (`draft_rows` is d / b). So each running request, oldest first, proposes while
    its recent acceptance is at least R / (R + overhead_rows), R counting the step's rows so far
    (one a running request, and the drafts handed out): at one request on the default model
    (a / b about 3) a request whose drafts are kept a quarter of the time gains; at 16 it needs 84%.
    A request under its threshold rests, and every probe_every steps proposes one draft (its
    acceptance may have changed with its text; one row is the cheapest way to find out), unless the
    threshold is over 1: then no acceptance could pay, and a draft model's probe would cost it a
    forward (and the catch-up on every token since its last).

    The cost model leaves out what start-up timing cannot see (the host's work per verified row, the
    machine's drift), so the rule also measures: the engine reports every decode step's wall time per
    token it gave (observe_step; less a draft model's catch-up past steady drafting, paid once by a
    request that rested, or a rested draft would look dearer than drafting is), into one running
    mean for steps that verified drafts and one for steps that did not. While drafting steps cost
    more per token, no request drafts but on every probe_every-th step; while they cost less, every
    probe_every-th step drafts nothing, so both means stay current. A draft model must also see
    every token before it can draft the next: a request's first drafts catch it up on the whole
    prompt, a rested request's on every token since, in one forward the step times leave out. So
    outside the probing steps a request drafts only where that catch-up pays: where the seconds a
    token drafting saves (the two means' difference) times the tokens it may still give
    (max_tokens) exceed the catch-up's (`catch_up_seconds` a token, timed at start-up). A draft no
    faster than the target's own steps then never pays for a long prompt. A probing step's catch-up
    is its exploration's price: a request probes only where it costs at most PROBE_SHARE of the
    decode time since a step last drafted (a whole prompt's catch-up each probe cost the default
    model in bf16 a fifth of its time, drafted by its own Q4_1 file). A fixed min_acceptance
    turns the cost model, the measurement and the catch-up's charge off. Its draft length follows
    transformers' schedule for assisted generation: two more after a verification that kept every
    draft, one fewer after one that did not, up to num_speculative_tokens.
    """

    def __init__(self, config: SpeculativeConfig, overhead_rows: float | None = None, draft_rows: float = 0.0) -> None:
        self.config = config
        # ngram proposes here, before schedule; a draft model proposes after it, over placeholders.
        self.proposer = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                         if config.method == "ngram" else None)
        self.overhead_rows = overhead_rows if config.overhead_rows == "auto" else config.overhead_rows
        self.draft_rows = draft_rows  # what proposing one draft costs, in rows (a draft model's forward)
        # A draft model's catch-up: seconds a token of its forward over many (None: not timed, no charge).
        self.catch_up_seconds: float | None = None
        # Measured: seconds per token of decode steps that verified drafts (True) and that did not.
        self.seconds_per_token: dict[bool, float | None] = {True: None, False: None}
        self.num_steps = 0
        self.probing = False  # this step drafts only to measure drafting again (it costs more per token)
        self.seconds_since_drafting = 0.0  # decode steps' seconds since a step last verified drafts

    @property
    def needs_calibration(self) -> bool:
        """Whether the rule needs overhead_rows timed (config "auto", and no fixed min_acceptance)."""
        return self.overhead_rows is None and self.config.min_acceptance is None

    def threshold(self, rows: int) -> float:
        """The least recent acceptance that lets a request draft in a step of `rows` rows so far."""
        if self.config.min_acceptance is not None:
            return self.config.min_acceptance
        overhead = 0.0 if self.overhead_rows is None else self.overhead_rows
        return rows * (1.0 + self.draft_rows) / (rows + overhead) if rows + overhead > 0 else 0.0

    def observe_step(self, drafted: bool, num_tokens: int, seconds: float) -> None:
        """Counts one decode step's wall time per token it gave, into the measured arm: steps that
        verified drafts, or steps that did not."""
        if num_tokens < 1:
            return
        self.seconds_per_token[drafted] = running_mean(self.seconds_per_token[drafted], seconds / num_tokens)
        self.seconds_since_drafting = 0.0 if drafted else self.seconds_since_drafting + seconds

    def speculating(self) -> bool:
        """Whether this step may draft at all, by the step times measured (see the class): each
        probe_every-th step goes to the arm that looks slower, every other step to the faster."""
        self.num_steps += 1
        self.probing = False
        if self.config.min_acceptance is not None:
            return True  # a fixed floor: the caller chose
        spec, plain = self.seconds_per_token[True], self.seconds_per_token[False]
        refresh = self.num_steps % self.config.probe_every == 0
        if spec is None or plain is None:
            return not (refresh and spec is not None)  # until plain steps are measured too
        self.probing = refresh and spec > plain
        return (spec <= plain) != refresh

    def catch_up_pays(self, request: Any) -> bool:
        """Whether a draft model's catch-up on the tokens it has not seen, past the one or two of
        steady drafting, costs less than drafting can save the request, or on a probing step less
        than PROBE_SHARE of the time since a step last drafted (see the class). True where nothing
        is measured yet, and under a fixed min_acceptance."""
        spec, plain, per_token = self.seconds_per_token[True], self.seconds_per_token[False], self.catch_up_seconds
        if self.config.min_acceptance is not None or None in (spec, plain, per_token):
            return True
        behind = request.num_tokens - min(request.num_draft_computed, request.num_computed_tokens) - 2
        catch_up = max(0, behind) * per_token
        if self.probing:
            return catch_up <= PROBE_SHARE * self.seconds_since_drafting
        return (plain - spec) * (request.params.max_tokens - request.num_output_tokens) > catch_up

    def assign(self, requests: Sequence[Any]) -> None:
        """Sets each request's draft_token_ids for the next schedule: [] for those that do not
        speculate. `requests`: the running requests, admission order (the scheduler's)."""
        cfg = self.config
        rows = len(requests)
        for request in requests:
            request.draft_token_ids = []
        if not self.speculating():
            return
        for request in requests:
            if request.num_tokens - request.num_computed_tokens != 1 or request.num_pending_tokens:
                continue  # a prompt still prefilling, or a token still on its way home
            k = min(request.spec_k or cfg.num_speculative_tokens, cfg.num_speculative_tokens,
                    request.params.max_tokens - request.num_output_tokens - 1)
            if cfg.max_step_rows is not None:
                k = min(k, cfg.max_step_rows - rows)
            if k < 1:
                continue
            threshold = self.threshold(rows)
            if threshold > 1.0:
                continue  # not even drafts that are always kept would pay: no probe either
            if request.spec_acceptance < threshold:
                request.spec_skipped += 1
                if request.spec_skipped < cfg.probe_every:
                    continue
                request.spec_skipped, k = 0, 1  # a probe: the cheapest bet that can show a change
            if self.proposer is None:
                if not self.catch_up_pays(request):
                    continue
                request.draft_token_ids = [PLACEHOLDER] * k  # the draft model's, after schedule
                rows += k
                continue
            drafts = self.proposer.propose(request.token_ids, k)
            if drafts and request.grammar is not None:
                drafts = request.grammar.longest_allowed(drafts)
            request.draft_token_ids = drafts
            rows += len(drafts)


def row_seconds(seconds_one: float, seconds_wide: float, wide: int) -> float:
    """b of a step costing a + b R, from its times at 1 row and at `wide` rows (above 0)."""
    return max((seconds_wide - seconds_one) / (wide - 1), 1e-9)


def overhead_rows(seconds_one: float, seconds_wide: float, wide: int) -> float:
    """a / b of a step costing a + b R, from its times at 1 row and at `wide` rows (at least 0: a step
    can cost no less than its rows)."""
    per_row = row_seconds(seconds_one, seconds_wide, wide)
    return max(0.0, (seconds_one - per_row) / per_row)


def running_mean(mean: float | None, value: float) -> float:
    """`mean` moved MEASURE_WEIGHT of the way to `value` (the value itself when there is none yet)."""
    return value if mean is None else mean + MEASURE_WEIGHT * (value - mean)


def observe(request: Any, num_drafted: int, num_accepted: int) -> None:
    """Counts one verification of `num_drafted` drafts of which `num_accepted` were kept."""
    request.num_drafts += 1
    request.num_draft_tokens += num_drafted
    request.num_accepted_tokens += num_accepted
    request.spec_acceptance = 0.5 * request.spec_acceptance + 0.5 * (num_accepted / num_drafted)
    # transformers' schedule for its assistant's draft length: two more after a step that kept every
    # draft, one fewer after one that did not (SpeculationRule caps it at num_speculative_tokens).
    request.spec_k = num_drafted + 2 if num_accepted == num_drafted else max(1, num_drafted - 1)
