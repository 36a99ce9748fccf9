"""build_inputs: SchedulerOutput -> ModelInputs (through TokenRuns). The one place a step's tensors are born."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.model.attention import AttentionMetadata, DecodeGroup, PrefillRun
from nanoserve.model.llama import ModelInputs
from nanoserve.readback import TokenBatch
from nanoserve.scheduler import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class TokenRun:
    """One sequence's tokens in a step, as the input builder lays them out: a request's (token_runs),
    a draft model's, or a timing's."""

    token_ids: list[int]  # the tokens forwarded, drafts included
    start: int  # the position of the first (its cached context: start tokens)
    block_ids: list[int]  # the sequence's blocks, covering start + len(token_ids) positions
    num_sampling: int = 0  # its last rows that sample: 1 + drafts, or 0 (a prompt chunk short of its end)
    pending: tuple[int, int] | None = None  # (index in token_ids, row of the pending batch): a token not home yet
    scored: tuple[int, int] = (0, 0)  # (first index in token_ids, count): rows whose logits score the next prompt token
    pooled: tuple[int, int] | None = None  # an embedding's (first index in token_ids, count): rows it pools; None: not one


def prompt_scoring(item: ScheduledRequest) -> tuple[int, int]:
    """(first position, count): the prompt positions of a scheduled chunk whose logits score the
    prompt token after them, for a request asking for prompt logprobs, once each (entries already
    made are skipped: a preempted request forwards its prompt again); (0, 0) for none. The last
    prompt position is the row that samples, and scores no prompt token."""
    request = item.request
    if request.prompt_logprobs is None:
        return 0, 0
    start = request.num_computed_tokens
    first = max(start, len(request.prompt_logprobs) - 1)
    end = min(start + item.num_new_tokens - len(item.draft_token_ids), request.num_prompt_tokens - 1)
    return (first, end - first) if end > first else (0, 0)


def pooling_rows(item: ScheduledRequest) -> tuple[int, int] | None:
    """(first position, count): the prompt positions of an embedding request's scheduled chunk
    whose final-normed rows it pools (PoolingParams.positions), each once (positions before
    request.num_pooled_tokens were pooled before a preemption, and are skipped); None for a request
    that is not an embedding."""
    request = item.request
    if request.pooling is None:
        return None
    start = request.num_computed_tokens
    wanted = request.pooling.positions(request.num_prompt_tokens)
    first = max(start, request.num_pooled_tokens, wanted.start)
    end = min(start + item.num_new_tokens, wanted.stop)
    return (first, end - first) if end > first else (first, 0)


def token_runs(sched: SchedulerOutput, pending: TokenBatch | None = None) -> list[TokenRun]:
    """The scheduled requests' runs: each forwards its tokens from num_computed_tokens on, its
    speculative drafts after its last token. A token sampled last step and not yet brought home
    (deferred output) is found in the pending batch by request id."""
    runs = []
    for item in sched.scheduled:
        request, start = item.request, item.request.num_computed_tokens
        drafts = item.draft_token_ids
        known_end = start + item.num_new_tokens - len(drafts)
        token_ids = request.token_ids[start:known_end]
        where = None
        if known_end > len(request.token_ids):  # the last input is the pending token
            where = (len(token_ids), pending.request_ids.index(request.request_id))
            token_ids.append(0)
        first, count = prompt_scoring(item)
        pooled = pooling_rows(item)
        runs.append(TokenRun(token_ids + drafts, start, request.block_ids, (1 + len(drafts)) * item.samples, where,
                             (first - start, count), pooled and (pooled[0] - start, pooled[1])))
    return runs


def build_inputs(sched: SchedulerOutput, block_size: int, device: torch.device,
                 pending: TokenBatch | None = None, decode_group_min_rows: int | None = 8,
                 sliding_window: int | None = None) -> ModelInputs:
    """The scheduled step's ModelInputs (token_runs, then lay_out)."""
    return lay_out(token_runs(sched, pending), block_size, device, pending, decode_group_min_rows, sliding_window)


def lay_out(runs: list[TokenRun], block_size: int, device: torch.device, pending: TokenBatch | None = None,
            decode_group_min_rows: int | None = 8, sliding_window: int | None = None) -> ModelInputs:
    """Flattens the runs into one batch of T tokens with its attention metadata.

    Each run's context for attention is everything up to its last token. A pending token's value is
    copied into input_ids from the pending batch's device tensor: it never visits the host. Every
    sampling row is in logits_indices, in order, and after them each run's scored rows (prompt
    logprobs), in order; each embedding run's pooled rows are in pooled_indices, in order (None
    when no run is an embedding's). With a sliding_window W (the model's
    config.sliding_window), the metadata also holds the step as windowed layers attend it, where a
    query at position p sees keys p - W + 1 .. p.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    logits_indices: list[int] = []
    scored_rows: list[int] = []
    pooled_rows: list[int] = []
    pools = False  # some run is an embedding's (its rows may be none this step)
    query_lens: list[int] = []
    context_lens: list[int] = []
    block_tables: list[list[int]] = []
    pending_dst: list[int] = []  # rows of input_ids whose token is still on the device
    pending_src: list[int] = []  # ... and the row of the pending batch that holds it
    for run in runs:
        start, blocks = run.start, run.block_ids
        end = start + len(run.token_ids)
        if run.pending is not None:
            pending_dst.append(len(input_ids) + run.pending[0])
            pending_src.append(run.pending[1])
        input_ids.extend(run.token_ids)
        positions.extend(range(start, end))
        slot_mapping.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        logits_indices.extend(range(len(input_ids) - run.num_sampling, len(input_ids)))
        first = len(input_ids) - len(run.token_ids) + run.scored[0]
        scored_rows.extend(range(first, first + run.scored[1]))
        if run.pooled is not None:
            pools = True
            first = len(input_ids) - len(run.token_ids) + run.pooled[0]
            pooled_rows.extend(range(first, first + run.pooled[1]))
        query_lens.append(end - start)
        context_lens.append(end)
        block_tables.append(blocks)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    input_ids_t = tensor(input_ids)
    if pending_dst:
        input_ids_t[tensor(pending_dst)] = pending.tokens[tensor(pending_src)]
    num_seqs = len(query_lens)
    positions_t = tensor(positions)
    slot_mapping_t = tensor(slot_mapping)
    first_rows = [0] * num_seqs  # row of T where each sequence's tokens begin
    for i in range(1, num_seqs):
        first_rows[i] = first_rows[i - 1] + query_lens[i - 1]
    # No sequence is padded to another's query run: one-query sequences (decodes) are batched, split by
    # length from decode_group_min_rows rows on; a sequence forwarding several tokens (a prompt or a
    # chunk of one) is attended alone.
    decoding = [i for i in range(num_seqs) if query_lens[i] == 1]
    split = decode_group_min_rows is not None and len(decoding) >= decode_group_min_rows
    groups = split_by_length([-(-context_lens[i] // block_size) for i in decoding]) if split else [
        list(range(len(decoding)))]
    # split_by_length orders a group by length; the rows go back to row order, which a whole-step
    # group (no row index) relies on: its block table's row i must be T's row i.
    groups = [sorted(g) for g in groups]
    whole_step = len(groups) == 1 and len(decoding) == num_seqs  # one group, in row order: no gather or scatter

    def metadata(window: int | None) -> AttentionMetadata:
        decode_groups = [decode_group([decoding[j] for j in g], None if whole_step else first_rows, block_tables,
                                       context_lens, block_size, device, window) for g in groups if g]
        runs = [_prefill_run(first_rows[i], query_lens[i], context_lens[i], block_tables[i], block_size, device, window)
                for i in range(num_seqs) if query_lens[i] > 1]
        return AttentionMetadata(slot_mapping_t, decode_groups, runs, block_size, sliding_window)

    attn = metadata(None)
    if sliding_window is not None and max(context_lens) > sliding_window:  # else every key is inside the window
        attn.windowed = metadata(sliding_window)
    nb = max(len(b) for b in block_tables)
    attn.block_tables = torch.tensor([b + [0] * (nb - len(b)) for b in block_tables], dtype=torch.int64,
                                     device=device)  # [S, nb]
    attn.row_seqs = torch.repeat_interleave(torch.arange(num_seqs, device=device), tensor(query_lens))  # [T]
    return ModelInputs(input_ids_t, positions_t, tensor(logits_indices + scored_rows), attn,
                       tensor(pooled_rows) if pools else None)


def split_by_length(num_blocks: list[int], max_groups: int = 4, min_saving: float = 0.15) -> list[list[int]]:
    """Splits rows into at most max_groups groups of similar length to cut the padded area
    (rows x longest in group). A further group is taken only if it saves min_saving of the area.

    Returns lists of row indices, each sorted by length; one group holding every row when no split pays.
    """
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__)
    lengths = [num_blocks[i] for i in order]
    n = len(lengths)
    # best[g][j]: least padded area covering the j shortest rows with g groups; cut[g][j]: its last cut.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(max_groups + 1)]
    cut = [[0] * (n + 1) for _ in range(max_groups + 1)]
    best[0][0] = 0
    for g in range(1, max_groups + 1):
        for j in range(1, n + 1):
            for i in range(g - 1, j):
                area = best[g - 1][i] + (j - i) * lengths[j - 1]
                if area < best[g][j]:
                    best[g][j], cut[g][j] = area, i
    groups_used = 1
    for g in range(2, max_groups + 1):
        if best[g][n] <= best[groups_used][n] * (1 - min_saving):
            groups_used = g
    bounds, j = [], n
    for g in range(groups_used, 0, -1):
        bounds.append((cut[g][j], j))
        j = cut[g][j]
    return [order[a:b] for a, b in reversed(bounds)]


def decode_group(rows: list[int], first_rows: list[int] | None, block_tables: list[list[int]],
                  context_lens: list[int], block_size: int, device: torch.device,
                  window: int | None = None) -> DecodeGroup:
    """Sequences `rows`, one query each (at row first_rows[r] of T), attended as one batch;
    first_rows None: the group is the whole step in row order. With a window W, a row's table starts
    at the block holding its first visible key (its query is at L - 1: keys L - W .. L - 1)."""
    lens = [context_lens[r] for r in rows]
    first_keys = [0 if window is None else max(0, n - window) for n in lens]
    first_blocks = [key // block_size for key in first_keys]
    nb = max(-(-n // block_size) - b for n, b in zip(lens, first_blocks, strict=True))
    tables = [block_tables[r][b:b + nb] for r, b in zip(rows, first_blocks, strict=True)]
    table = torch.tensor([t + [0] * (nb - len(t)) for t in tables])  # [Bg, nb]
    # Each row sees the indices lo .. hi - 1 of its gathered keys [nb * bs].
    lo = [key - b * block_size for key, b in zip(first_keys, first_blocks, strict=True)]
    hi = [n - b * block_size for n, b in zip(lens, first_blocks, strict=True)]
    mask = None
    if any(lo) or any(h != nb * block_size for h in hi):
        key_index = torch.arange(nb * block_size)[None, :]  # [1, Lg]
        visible = (key_index >= torch.tensor(lo)[:, None]) & (key_index < torch.tensor(hi)[:, None])  # [Bg, Lg]
        mask = visible[:, None, None, :].to(device)  # [Bg, 1, 1, Lg]
    row_index = None if first_rows is None else torch.tensor([first_rows[r] for r in rows], device=device)
    return DecodeGroup(row_index, table.to(device), mask)


def _prefill_run(first_row: int, query_len: int, context_len: int, blocks: list[int], block_size: int,
                 device: torch.device, window: int | None = None) -> PrefillRun:
    """One sequence's Tq new tokens at positions context_len - Tq .. context_len - 1. With a window W,
    query p sees keys p - W + 1 .. p, and the table starts at the block the first query's window reaches."""
    start = context_len - query_len
    query_pos = torch.arange(start, context_len)[:, None]  # [Tq, 1]
    if start == 0:  # nothing cached: attention over the new tokens alone, no gather
        if window is None or query_len <= window:
            return PrefillRun(first_row, query_len, None, None)  # causal
        key_pos = torch.arange(query_len)[None, :]  # [1, Tq]
        visible = (key_pos <= query_pos) & (key_pos > query_pos - window)  # [Tq, Tq]
        return PrefillRun(first_row, query_len, None, visible[None, None].to(device))
    first_block = 0 if window is None else max(0, start - window + 1) // block_size
    nb = -(-context_len // block_size)
    key_pos = torch.arange(first_block * block_size, nb * block_size)[None, :]  # [1, L]
    visible = key_pos <= query_pos  # [Tq, L]
    if window is not None:
        visible &= key_pos > query_pos - window
    return PrefillRun(first_row, query_len, torch.tensor([blocks[first_block:nb]], device=device),
                      visible[None, None].to(device))
