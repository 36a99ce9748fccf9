"""Request: one generation's (or one embedding's) token ids, progress counters and timestamps; RequestOutput."""

from __future__ import annotations

import enum
import itertools
import operator
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from nanoserve.params import PoolingParams, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the caller


class Request:
    """A request as the engine tracks it.

    Progress is two counters, not a phase: the request has `num_tokens` tokens (prompt plus
    output so far) and the KV cache holds the first `num_computed_tokens` of them. Prefill,
    a prefill chunk, a decode and a recompute after preemption are all "forward the tokens
    from num_computed_tokens up to num_tokens".

    `token_ids`, `token_times` and `logprobs` only ever grow by appending: each step's
    RequestOutput holds views of them (ListView) rather than copies.

    An embedding request (`pooling` set) forwards its prompt as any request does and never
    samples: each step that forwards rows it pools sends their sum home, `pooled_sum` adds them up
    in step order, and once the last prompt token is forwarded `embedding` is the vector and the
    request is finished. Its `params` are EMBEDDING_PARAMS, which no sampler reads.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        arrival_time: float | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output, grows by one per step
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_pending_tokens = 0  # deferred output: sampled on the device, not yet appended
        self.block_ids: list[int] = []  # KV blocks owned, in position order
        self.block_hashes: list[bytes] = []  # prefix-cache hashes of its leading full blocks
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.stop_text: str | None = None  # output text cut before a matched stop string
        self.num_stop_scanned_chars = 0  # output text already searched for stop strings
        self.detokenizer: Any = None  # the engine's IncrementalDetokenizer: output text, O(1) per token
        self.grammar: Any = None  # structured outputs or a think block: a RequestGrammar or ReasoningGrammar, fed each output token
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # params.prompt_logprobs: entry p for prompt token p (the first None), filled as the prompt is forwarded
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        # Embedding requests: rows of prompt positions before num_pooled_tokens are pooled already (a
        # preempted request forwards its prompt again and skips them); their sum, as it comes home.
        self.pooling = pooling
        self.num_pooled_tokens = 0
        self.pooled_sum: list[float] | None = None  # [E] float64, the pooled rows' sum so far
        self.num_pooled_rows = 0
        self.embedding: list[float] | None = None  # PoolingParams.finish's vector, once finished
        # Speculative decoding (nanoserve.speculative): the drafts this step verifies, and the counts.
        self.draft_token_ids: list[int] = []
        self.num_drafts = 0  # steps that verified drafts of this request
        self.num_draft_tokens = 0  # drafts verified
        self.num_accepted_tokens = 0  # of those, kept
        self.spec_acceptance = 1.0  # recent accepted / drafted, halved toward each new verification's
        self.spec_skipped = 0  # steps skipped since acceptance fell under the rule's floor
        self.spec_k: int | None = None  # drafts it may carry next (None: the config's k)
        self.num_draft_computed = 0  # method "draft_model": leading tokens whose K/V the draft's pool holds
        self.parent_id: str | None = None  # n > 1: the id add_request returned for the group
        self.index = 0  # n > 1: which completion of the prompt this is
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        # Timestamps, all time.perf_counter() seconds.
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.token_times: list[float] = []
        self.running_s = 0.0  # seconds holding a running slot, summed over admissions
        self._running_since: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def forwards_whole_prompt(self) -> bool:
        """Every prompt row is needed (prompt logprobs, mean or cls pooling): no prefix-cache hits."""
        return self.prompt_logprobs is not None or (self.pooling is not None and self.pooling.pooling != "last")

    def add_pooled(self, part: list[float], num_rows: int) -> None:
        """Adds one step's sum of pooled rows ([E]) to the request's, in float64."""
        if self.pooled_sum is None:
            self.pooled_sum = [0.0] * len(part)
        self.pooled_sum = [a + b for a, b in zip(self.pooled_sum, part, strict=True)]
        self.num_pooled_rows += num_rows

    @property
    def num_tokens(self) -> int:
        """Tokens the request holds, counting one sampled but not yet brought home."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def is_length_capped(self) -> bool:
        """Its pending token is its last: nothing more is forwarded for it (no overshoot by length)."""
        return self.num_output_tokens + self.num_pending_tokens >= self.params.max_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def mark_running(self, now: float) -> None:
        self.status = RequestStatus.RUNNING
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now
        self._running_since = now

    def mark_not_running(self, now: float) -> None:
        if self._running_since is not None:
            self.running_s += now - self._running_since
            self._running_since = None

    def append_token(self, token_id: int, now: float) -> bool:
        """Appends one sampled token and applies the stop rules. Returns True if it finished."""
        self.token_ids.append(token_id)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now
        params = self.params
        if self.num_output_tokens <= params.min_tokens - 1:
            pass  # too early for any stop rule (the sampler masked EOS and stop tokens anyway)
        elif token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            self.stop_reason = token_id if token_id in params.stop_token_ids else None
            self.finish(FinishReason.STOP, now)
        elif self.num_output_tokens >= params.max_tokens:
            self.finish(FinishReason.LENGTH, now)
        return self.is_finished

    def finish(self, reason: FinishReason, now: float) -> None:
        self.mark_not_running(now)
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.finished_time = now


class ListView(Sequence):
    """A read-only view of `items[start:stop]`, its bounds fixed when it is made.

    Made in O(1) over a list that only grows by appending, it shows the same elements however the
    list grows afterwards: a RequestOutput holds views of its request's lists, so building one
    costs the same at the thousandth token as at the first, and an output kept from an earlier
    step still reads as it did then. It compares equal to a list, tuple or view of the same
    elements, concatenates with them into a list, and a slice of it is a list.
    """

    __slots__ = ("_items", "_start", "_stop")

    def __init__(self, items: list, start: int = 0, stop: int | None = None) -> None:
        self._items = items
        self._start = start
        self._stop = len(items) if stop is None else stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index):
        where = range(self._start, self._stop)[index]  # bounds and negative indices, as a list has them
        if isinstance(where, int):
            return self._items[where]
        if where.step == 1:
            return self._items[where.start : where.stop]
        return [self._items[i] for i in where]

    def __iter__(self) -> Iterator:
        return itertools.islice(self._items, self._start, self._stop)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (ListView, list, tuple)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # like a list's: equal to lists, so it cannot hash as they do not

    def __add__(self, other: object) -> list:
        return [*self, *other] if isinstance(other, (ListView, list, tuple)) else NotImplemented

    def __radd__(self, other: object) -> list:
        return [*other, *self] if isinstance(other, (ListView, list, tuple)) else NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self):
        return ListView, (list(self),)  # only the viewed elements travel


@dataclass
class RequestOutput:
    """What the caller sees of a request after a step (or at the end of generate).

    The engine fills `token_ids`, `token_times` and `logprobs` with ListViews of the request's own
    lists (read-only, fixed at this step's length; `list(...)` makes a list of one).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: Sequence[int]  # output tokens so far
    text: str  # output text so far, special tokens skipped
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    token_times: Sequence[float] = ()  # one perf_counter stamp per output token
    running_s: float = 0.0  # seconds holding a running slot
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    logprobs: Sequence[dict[int, float]] | None = None  # per output token: sampled and top-k token -> logprob
    # per prompt token (params.prompt_logprobs): None for the first, then its own and the top-k's
    # logprob at its position; complete once the prompt is forwarded (from the first token on)
    prompt_logprobs: Sequence[dict[int, float] | None] | None = None
    parent_id: str | None = None  # n > 1: the id add_request returned; request_id is f"{parent_id}.{index}"
    index: int = 0  # n > 1: which completion of the prompt
    num_drafts: int = 0  # speculative decoding: steps that verified drafts for this request
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts kept (each saved one step)
    embedding: list[float] | None = None  # an embedding request's vector, once finished (PoolingParams)


# An embedding request's SamplingParams: it never samples, so nothing reads them.
EMBEDDING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)

PROMPT_TYPES = "prompt must be a str or a list of token ids (int)"


def prompt_token_ids(prompt: str | Sequence[int], tokenizer: Any) -> list[int]:
    """The prompt as token ids: a string is encoded by the tokenizer, ids are taken as given.

    Token ids come as a sequence (a list, a tuple, an output's token_ids) of ints, numpy and
    torch integer scalars included, or as a 1-D integer array or tensor. A bool is not a token id.

    Raises:
        ValueError: a prompt of any other type (naming it, or the first element that is not a
            token id), an empty prompt, or text with no tokenizer to encode it.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty: it needs at least 1 token")
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; this engine has none, pass token ids")
        token_ids = list(tokenizer.encode(prompt))
    else:
        token_ids = _token_ids(prompt)
    if not token_ids:
        raise ValueError("prompt is empty: it needs at least 1 token")
    return token_ids


def _token_ids(prompt: Any) -> list[int]:
    """Checks ids handed in as a prompt; see prompt_token_ids."""
    container = _type_name(prompt)
    if type(prompt) is list and all(type(t) is int for t in prompt):
        return list(prompt)  # the common case: nothing to convert
    if hasattr(prompt, "tolist") and hasattr(prompt, "ndim"):  # a numpy array or a torch tensor
        if prompt.ndim != 1:
            raise ValueError(f"{PROMPT_TYPES}; got a {prompt.ndim}-D {container}")
        prompt = prompt.tolist()  # Python ints, or floats or bools that the loop below names
    elif not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)):
        hint = " (a mapping: pass its ['input_ids'])" if hasattr(prompt, "keys") and "input_ids" in prompt else ""
        raise ValueError(f"{PROMPT_TYPES}; got {container}{hint}")
    token_ids = []
    for i, t in enumerate(prompt):
        token_id = _as_token_id(t)
        if token_id is None:
            raise ValueError(f"{PROMPT_TYPES}; got a {container} holding {_type_name(t)} at index {i}")
        token_ids.append(token_id)
    return token_ids


def _as_token_id(value: Any) -> int | None:
    """`value` as an int if it is one (an int, a numpy or torch integer scalar), else None."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")) or getattr(value, "ndim", 0):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _type_name(value: Any) -> str:
    if value is None:
        return "None"
    name, dtype = type(value).__name__, getattr(value, "dtype", None)
    return name if dtype is None or str(dtype) == name else f"{name} of {dtype}"  # "Tensor of torch.float32", "int64"


def check_request(token_ids: list[int], params: SamplingParams, *, has_tokenizer: bool, vocab_size: int,
                  max_model_len: int, block_size: int, num_blocks: int, is_embedding: bool = False) -> None:
    """Refuses, at the door, a request the engine could never finish (an embedding request: its
    prompt alone, nothing generated after it).

    Raises:
        ValueError: params that are not SamplingParams, stop strings or structured outputs with no
            tokenizer, a token id (prompt or reasoning marker) outside the vocabulary, prompt plus max_tokens over
            max_model_len, or a request the whole KV pool could not hold at its full length.
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    if params.stop and not has_tokenizer:
        raise ValueError(f"stop={params.stop!r} needs a tokenizer; this engine has none")
    if params.structured_outputs is not None and not has_tokenizer:
        raise ValueError("structured_outputs needs a tokenizer (the grammar is matched on its tokens); this engine has none")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    for name in ("reasoning_end_token_ids", "reasoning_start_token_ids"):
        bad = next((t for t in getattr(params, name) if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name}={getattr(params, name)!r}: token id {bad} is outside the vocabulary "
                             f"[0, {vocab_size})")
    total = len(token_ids) + (0 if is_embedding else params.max_tokens)
    if is_embedding and total > max_model_len:
        raise ValueError(f"prompt ({total} tokens) exceeds max_model_len={max_model_len}")
    if total > max_model_len:
        raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                         f"exceeds max_model_len={max_model_len}")
    blocks = -(-total // block_size)
    if blocks > num_blocks:
        raise ValueError(f"request needs {blocks} KV blocks at full length, the whole pool has {num_blocks}")
