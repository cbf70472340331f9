"""Turns a scheduled step into the engine's flat input tensors (DESIGN.md, "The engine step").

A speculating sequence (DESIGN.md) goes through the context phase with its last token and its
draft tokens, and gets logits at every one of them. Block tables come from the KV cache manager's `block_tables` rows (one per sequence holding
blocks, kept up to date as blocks are added): a step gathers the rows it needs, and the decode
tokens' slots are computed from them in one tensor expression. Only prefill chunks, whose tokens
are few per request but many per step, are laid out token by token.
"""
from dataclasses import dataclass, field

import torch

from kiln.runtime.scheduler import SchedulerOutput
from kiln.runtime.sequence import Sequence

I64 = dict(dtype=torch.int64)


@dataclass
class StepPlan:
    inputs: dict
    # Sequences to sample, each with its row in the logits.
    sample: list[tuple[Sequence, int]] = field(default_factory=list)
    # Prompt logprobs: (sequence, first prompt position predicted, logits rows).
    prompt_rows: list[tuple[Sequence, int, list[int]]] = field(default_factory=list)
    # return_context_logits: (sequence, logits rows of the prompt positions it computes this step).
    context_rows: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    # Speculating sequences: their logits rows, at the last token and at each draft token.
    verify: list[tuple[Sequence, list[int]]] = field(default_factory=list)


def tables_of(seqs: list[Sequence]) -> torch.Tensor:
    """block_tables for sequences whose block_table was laid out by hand (tests, benchmarks): row i
    is seqs[i]'s."""
    tables = torch.zeros((len(seqs), max(len(s.block_table) for s in seqs)), dtype=torch.int32)
    for i, seq in enumerate(seqs):
        seq.row = i
        tables[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
    return tables


def _tables(block_tables: torch.Tensor, rows: list[int], width: int) -> torch.Tensor:
    return block_tables[:, :max(width, 1)].index_select(0, torch.tensor(rows, **I64))


def plan_step(out: SchedulerOutput, tokens_per_block: int, block_tables: torch.Tensor) -> StepPlan:
    tpb = tokens_per_block
    input_ids, positions = [], []
    ctx_index, ctx_rows, ctx_lens, ctx_slots = [], [], [], []
    gen_index, gen_rows, gen_pos = [], [], []
    logits_index = []
    plan = StepPlan(inputs={})
    for seq, n in out.scheduled:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        first = len(input_ids)
        if n == 1:
            input_ids.append(seq.token_ids[start])
            positions.append(start)
            gen_index.append(first)
            gen_rows.append(seq.row)
            gen_pos.append(start)
        else:
            input_ids.extend((seq.token_ids + seq.draft_token_ids if seq.draft_token_ids else seq.token_ids)[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            ctx_slots.extend((first + p - start, table[p // tpb] * tpb + p % tpb) for p in range(start, end))
            ctx_index.append(range(first, first + n))
            ctx_rows.append(seq.row)
            ctx_lens.append(end)
        req = seq.request
        if req.prompt_logprobs is not None:
            # Logits at position p predict prompt token p + 1; after a preemption the positions
            # already scored are not scored again.
            lo, hi = max(start, len(req.prompt_logprobs) - 1), min(end, req.num_prompt_tokens - 1)
            if lo < hi:
                plan.prompt_rows.append((seq, lo + 1, list(range(len(logits_index), len(logits_index) + hi - lo))))
                logits_index.extend(range(first + lo - start, first + hi - start))
        if req.params.return_context_logits:
            done = 0 if req.context_logits is None else len(req.context_logits)
            lo, hi = max(start, done), min(end, req.num_prompt_tokens)
            if lo < hi:
                plan.context_rows.append((seq, list(range(len(logits_index), len(logits_index) + hi - lo))))
                logits_index.extend(range(first + lo - start, first + hi - start))
        if seq.draft_token_ids:  # the last token and every draft: the target's next-token rows
            plan.verify.append((seq, list(range(len(logits_index), len(logits_index) + n))))
            logits_index.extend(range(first, first + n))
        elif end == seq.num_tokens:
            plan.sample.append((seq, len(logits_index)))
            logits_index.append(first + n - 1)
    if not logits_index:
        logits_index.append(0)  # the graph returns at least one row; nobody reads it

    slot_mapping = torch.empty(len(input_ids), **I64)
    gen_tables = _tables(block_tables, gen_rows, -(-(max(gen_pos, default=0) + 1) // tpb))
    gen_positions = torch.tensor(gen_pos, **I64)
    if gen_rows:
        pages = gen_tables.gather(1, (gen_positions // tpb).unsqueeze(1)).squeeze(1).long()
        slot_mapping[torch.tensor(gen_index, **I64)] = pages * tpb + gen_positions % tpb
    if ctx_slots:
        flat, slots = zip(*ctx_slots)
        slot_mapping[torch.tensor(flat, **I64)] = torch.tensor(slots, **I64)
    width = max((len(r) for r in ctx_index), default=1)
    ctx_token_index = torch.full((len(ctx_index), width), -1, **I64)
    for i, r in enumerate(ctx_index):
        ctx_token_index[i, :len(r)] = torch.arange(r.start, r.stop)
    plan.inputs = dict(
        input_ids=torch.tensor(input_ids, **I64),
        positions=torch.tensor(positions, **I64),
        slot_mapping=slot_mapping,
        ctx_token_index=ctx_token_index,
        ctx_block_tables=_tables(block_tables, ctx_rows, -(-max(ctx_lens, default=1) // tpb)),
        ctx_context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        gen_token_index=torch.tensor(gen_index, **I64),
        gen_block_tables=gen_tables,
        gen_context_lens=(gen_positions + 1).to(torch.int32),
        logits_index=torch.tensor(logits_index, **I64),
    )
    return plan
