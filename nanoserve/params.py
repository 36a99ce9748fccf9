"""SamplingParams: what one request asks of the sampler, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, with vLLM's meanings.

    temperature 0 is greedy. top_k -1 or 0 means no limit. With ignore_eos the request runs
    past EOS (EOS is not masked, as in vLLM); stop_token_ids still stop it.
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
    n: int = 1  # completions of one prompt; the copies share the prompt's full blocks

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
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs={self.logprobs!r} must be None or an integer in [0, 20]")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")
        # Normalised once here so the hot path can rely on tuples (a frozen dataclass needs
        # object.__setattr__ for that, inside its own __post_init__ only).
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """True when the sampler must see the request's tokens (penalties, min_tokens)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0)

    @property
    def has_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
