"""SamplingParams: what one request asks of the sampler; PoolingParams: what an embedding request
asks of the pooler. Both validated at construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match, with vLLM's StructuredOutputsParams names; exactly one
    is set. A JSON schema is kept as its compact JSON text (key order kept: it is the order the
    output's properties are generated in), so SamplingParams stays hashable.

    json: a JSON schema, as a dict or its JSON text. json_object: any JSON object. regex: a
    regular expression the whole output matches. grammar: an EBNF grammar (xgrammar's GBNF
    dialect, rule `root`). choice: the output is exactly one of these strings.
    """

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "grammar", "choice") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs sets {given or 'nothing'}: exactly one of json, json_object, "
                             "regex, grammar, choice must be set")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"json={self.json[:80]!r} is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"json={self.json!r} must be a JSON schema object")
            object.__setattr__(self, "json", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}={value!r} must be a non-empty string")
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else tuple(self.choice)
            if not choice or any(not isinstance(c, str) or not c for c in choice):
                raise ValueError(f"choice={self.choice!r} must be one or more non-empty strings")
            object.__setattr__(self, "choice", choice)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, with vLLM's meanings.

    temperature 0 is greedy. top_k -1 or 0 means no limit. With ignore_eos the request runs
    past EOS (EOS is not masked, as in vLLM); stop_token_ids still stop it. With
    reasoning_end_token_ids a think block may come first (nanoserve.reasoning): structured_outputs
    holds only what follows its end marker, and max_reasoning_tokens forces that marker.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: same tokens whatever else is in the batch
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the match, which is not included
    min_tokens: int = 0  # EOS, stop tokens and stop strings cannot end the request before this many
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt or output (HF / vLLM rule)
    presence_penalty: float = 0.0  # OpenAI: subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the top k (k <= 20)
    # vLLM's: None: none; k: each prompt token's logprob and the top k at its position (k <= 20), the
    # first token's None. Such a request forwards its whole prompt (no prefix-cache hits: a cached
    # prefix has no logits) and the head runs on its prompt's rows too.
    prompt_logprobs: int | None = None
    n: int = 1  # completions of one prompt; the copies share the prompt's full blocks
    structured_outputs: StructuredOutputs | None = None  # a grammar the output must match
    # A think block (nanoserve.reasoning): set, the grammar applies only after the end marker's ids.
    reasoning_end_token_ids: tuple[int, ...] = ()  # the end marker ("</think>"), as token ids
    reasoning_start_token_ids: tuple[int, ...] = ()  # set: thinking only where the prompt or output opens a block
    max_reasoning_tokens: int | None = None  # tokens in the block before the end is forced; None or -1: no limit

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be -1 or 0 (no limit) or a positive integer")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer or None")
        if not isinstance(self.n, int) or not 1 <= self.n <= 64:
            raise ValueError(f"n={self.n!r} must be an integer in [1, 64]")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens!r} must be in [0, max_tokens={self.max_tokens}]")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 20):
                raise ValueError(f"{name}={value!r} must be None or an integer in [0, 20]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(f"structured_outputs={self.structured_outputs!r} must be a StructuredOutputs")
        if self.structured_outputs is not None and self.min_tokens > 0:
            # Once the grammar is complete only EOS may follow, and min_tokens would mask that too:
            # the row would have no token left to sample.
            raise ValueError(f"min_tokens={self.min_tokens} cannot be combined with structured_outputs: a complete "
                             "grammar allows only EOS, which min_tokens forbids (send min_tokens=0)")
        self._check_reasoning()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")
        # Normalised once here so the hot path can rely on tuples (a frozen dataclass needs
        # object.__setattr__ for that, inside its own __post_init__ only).
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def _check_reasoning(self) -> None:
        for name in ("reasoning_end_token_ids", "reasoning_start_token_ids"):
            ids = getattr(self, name)
            if isinstance(ids, str | bytes) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                       for t in ids):
                raise ValueError(f"{name}={ids!r} must be a sequence of token ids (integers >= 0)")
            object.__setattr__(self, name, tuple(ids))
        budget = self.max_reasoning_tokens
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < -1):
            raise ValueError(f"max_reasoning_tokens={budget!r} must be -1 or None (no limit) or an integer >= 0")
        if budget == -1:
            object.__setattr__(self, "max_reasoning_tokens", None)
        if not self.reasoning_end_token_ids and (self.reasoning_start_token_ids or self.max_reasoning_tokens is not None):
            what = "reasoning_start_token_ids" if self.reasoning_start_token_ids else "max_reasoning_tokens"
            raise ValueError(f"{what}={getattr(self, what)!r} needs reasoning_end_token_ids: the think block's end "
                             "marker, as token ids")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """True when the sampler must see the request's tokens (penalties, min_tokens)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0)

    @property
    def has_reasoning_gate(self) -> bool:
        """True when a think block changes what may be sampled: a grammar waits for its end, or a
        budget may force it."""
        return bool(self.reasoning_end_token_ids) and (self.structured_outputs is not None
                                                       or self.max_reasoning_tokens is not None)

    @property
    def needs_resolved_output(self) -> bool:
        """True when the next token cannot be sampled before the last one is home: the sampler
        reads the history (penalties, min_tokens) or a grammar (or a reasoning budget) must accept
        it first."""
        return self.needs_history or self.structured_outputs is not None or self.has_reasoning_gate

    @property
    def has_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """What an embedding request asks (vLLM's PoolingParams): no token is sampled; the prompt's
    final-normed hidden states (the model's last_hidden_state) are pooled into one vector.

    pooling: "last" (the last prompt token's row: Qwen3-Embedding's), "mean" (every row's mean) or
    "cls" (the first token's row). normalize: the vector divided by its L2 norm. dimensions: the
    vector cut to its first `dimensions` values, then normalised again (OpenAI's `dimensions`, for
    Matryoshka-trained models); needs normalize, and at most the model's hidden size (checked at
    Engine.add_request).
    """

    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling={self.pooling!r} must be one of {POOLING_TYPES}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize={self.normalize!r} must be a bool")
        if self.dimensions is not None:
            if not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool) or self.dimensions < 1:
                raise ValueError(f"dimensions={self.dimensions!r} must be None or an integer >= 1")
            if not self.normalize:
                raise ValueError(f"dimensions={self.dimensions} needs normalize=True: a cut vector is "
                                 "normalised again, and this pooling does not normalise")

    def positions(self, num_prompt_tokens: int) -> range:
        """The prompt positions whose rows are pooled."""
        if self.pooling == "mean":
            return range(num_prompt_tokens)
        return range(1) if self.pooling == "cls" else range(num_prompt_tokens - 1, num_prompt_tokens)

    def finish(self, total: list[float], num_rows: int) -> list[float]:
        """The embedding from the sum of its pooled rows (`num_rows` of them), in float64: the mean
        for "mean", cut to `dimensions`, L2-normalised where asked (a zero vector stays zero)."""
        vector = [x / num_rows for x in total] if self.pooling == "mean" else list(total)
        if self.dimensions is not None:
            vector = vector[:self.dimensions]
        if self.normalize:
            norm = math.sqrt(math.fsum(x * x for x in vector))
            vector = [x / norm for x in vector] if norm > 0 else vector
        return vector
