"""One request's record: its `time.perf_counter()` stamps, and every latency derived from them.

The one per-request record of every instrument: an offline run's requests (`SystemRun`, built by
the runners), the serving metrics over a run's outputs (`request_metrics`) and the server's
histograms all hold a `RunRecord`. A stamp the request has not reached is None, and so is every
latency that needs it. Definitions follow vLLM's `benchmark_serving`:

    queue        = first_scheduled - arrival
    TTFT         = first_token - arrival
    TPOT         = (E2E - TTFT) / (output tokens - 1)     undefined for a one-token output
    decode rate  = (output tokens - 1) / (E2E - TTFT)      1 / TPOT: one row's tokens per second
    ITL          = token_times[i + 1] - token_times[i]     one per gap between output tokens
    E2E          = finished - arrival

TPOT and the decode rate are the functions `tpot` and `decode_rate`; every bench, the curve and the
server read them through a record's `tpot_s` / `decode_tok_per_s` or call them directly.
"""

from __future__ import annotations

from dataclasses import dataclass

_ROUNDING = 1 + 1e-9  # a sum of perf_counter intervals may exceed their span by float rounding


def tpot(num_output_tokens: int, ttft_s: float | None, e2e_s: float | None) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (output tokens - 1).

    Returns:
        Seconds; None for fewer than 2 output tokens or a missing TTFT or E2E.
    """
    if ttft_s is None or e2e_s is None or num_output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (num_output_tokens - 1)


def decode_rate(num_output_tokens: int, ttft_s: float | None, e2e_s: float | None) -> float | None:
    """One row's decode rate: (output tokens - 1) / (E2E - TTFT), the reciprocal of TPOT.

    Returns:
        Tokens per second; None where `tpot` is None or zero.
    """
    if ttft_s is None or e2e_s is None or num_output_tokens < 2 or e2e_s == ttft_s:
        return None
    return (num_output_tokens - 1) / (e2e_s - ttft_s)


@dataclass(frozen=True)
class RunRecord:
    """One request, placed on the perf_counter clock.

    Checked at construction to be a possible history: stamps in order, one stamp per output token,
    a first-token stamp exactly when there are tokens, and a finished request that produced a token
    held a slot for more than no time and no longer than it was in the system.
    """

    prompt_len: int  # prompt tokens
    token_ids: tuple[int, ...]  # output token ids, in order
    arrival_s: float  # stamp when the request was handed to the system
    first_token_s: float | None  # stamp when the first output token existed; None before it
    finished_s: float | None  # stamp when the request finished; None while it runs
    served_s: float  # seconds the request held a slot (engine: running_s; serial: the whole call)
    prefill_s: float | None  # seconds of the prompt forward (engine: first_token - first_scheduled; serial: ttft)
    request_id: str = ""  # the engine's id; "" where the runner had none
    first_scheduled_s: float | None = None  # stamp when it first held a slot; None if never or not recorded
    token_times: tuple[float, ...] | None = None  # [output_len] one stamp per output token; None: not recorded

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if self.token_times is not None:
            object.__setattr__(self, "token_times", tuple(float(t) for t in self.token_times))
        where = f"request {self.request_id}: " if self.request_id else ""
        if self.prompt_len < 1:
            raise ValueError(f"{where}prompt_len={self.prompt_len} must be >= 1")
        num_tokens = len(self.token_ids)
        if self.first_token_s is not None and num_tokens == 0:
            raise ValueError(f"{where}first_token_s={self.first_token_s} needs at least 1 output token, got 0")
        if self.first_token_s is None and num_tokens > 0:
            raise ValueError(f"{where}{num_tokens} output tokens but first_token_s=None; the first has a stamp")
        stamps = [
            (name, value)
            for name, value in (("arrival_s", self.arrival_s), ("first_scheduled_s", self.first_scheduled_s),
                                ("first_token_s", self.first_token_s), ("finished_s", self.finished_s))
            if value is not None
        ]
        if any(a[1] > b[1] for a, b in zip(stamps, stamps[1:], strict=False)):
            order = " <= ".join(f"{name}={value}" for name, value in stamps)
            raise ValueError(f"{where}stamps out of order: {order} must hold")
        self._check_token_times(where)
        self._check_served(where)
        if self.prefill_s is not None and not (
            self.ttft_s is not None and 0 <= self.prefill_s <= self.ttft_s * _ROUNDING
        ):
            raise ValueError(f"{where}prefill_s={self.prefill_s} must be >= 0 and <= ttft_s={self.ttft_s}")

    def _check_token_times(self, where: str) -> None:
        times = self.token_times
        if times is None:
            return
        if len(times) != len(self.token_ids):
            raise ValueError(
                f"{where}{len(times)} token_times for {len(self.token_ids)} output tokens; "
                "there must be exactly one stamp per output token"
            )
        for i in range(1, len(times)):
            if times[i] < times[i - 1]:
                raise ValueError(
                    f"{where}token_times[{i}]={times[i]} is before token_times[{i - 1}]={times[i - 1]}; "
                    "stamps must not go backwards"
                )

    def _check_served(self, where: str) -> None:
        if not self.served_s >= 0:
            raise ValueError(f"{where}served_s={self.served_s} must be >= 0")
        e2e = self.e2e_s
        if e2e is None:
            return
        if self.served_s > e2e * _ROUNDING or (self.token_ids and self.served_s == 0):
            raise ValueError(f"{where}served_s={self.served_s} must be > 0 and <= e2e_s={e2e}")

    # ---- counts, under both of their names

    @property
    def output_len(self) -> int:
        """Output tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens (the serving metrics' name for `output_len`)."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens (the serving metrics' name for `prompt_len`)."""
        return self.prompt_len

    @property
    def running_s(self) -> float:
        """Seconds holding a running slot (the engine's name for `served_s`)."""
        return self.served_s

    # ---- latencies

    @property
    def ttft_s(self) -> float | None:
        """Seconds from arrival to the first token, queue included; None before the first token."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        """Seconds from arrival to finish, how long the request was in the system; None while it runs."""
        return None if self.finished_s is None else self.finished_s - self.arrival_s

    @property
    def queue_s(self) -> float | None:
        """Seconds from arrival to first holding a slot; None if never scheduled or not recorded."""
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    @property
    def queued_s(self) -> float | None:
        """Seconds in the system without a slot (e2e - served); None while it runs."""
        e2e = self.e2e_s
        return None if e2e is None else e2e - self.served_s

    @property
    def tpot_s(self) -> float | None:
        """`tpot` of this request: (e2e - ttft) / (output tokens - 1)."""
        return tpot(self.output_len, self.ttft_s, self.e2e_s)

    @property
    def decode_tok_per_s(self) -> float | None:
        """`decode_rate` of this request: (output tokens - 1) / (e2e - ttft)."""
        return decode_rate(self.output_len, self.ttft_s, self.e2e_s)

    @property
    def itl_s(self) -> tuple[float, ...] | None:
        """[output_len - 1] gaps between consecutive output tokens; None where token_times were not recorded."""
        times = self.token_times
        if times is None:
            return None
        return tuple(b - a for a, b in zip(times, times[1:], strict=False))
