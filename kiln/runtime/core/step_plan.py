"""Plans a scheduled step: the engine's flat input tensors (DESIGN.md, "The engine format"; their
names: kiln/engine/format.py) and which rows of the logits it returns go where.

A speculating sequence (DESIGN.md) goes through the context phase with its last token and its
draft tokens, and gets logits at every one of them. A request asking for outputs at prompt
positions (kiln/runtime/core/prompt_logits.py) gets the rows of those the step computes.

Block tables come from the KV cache manager's `block_tables` rows (one per sequence holding
blocks, kept up to date as blocks are added): a step gathers the rows it needs. Slots come from
each sequence's block_table list, one per token.
"""
from dataclasses import dataclass, field

import torch

from kiln.runtime.core.prompt_logits import PromptOutput
from kiln.runtime.core.request import Sequence
from kiln.runtime.core.scheduler import SchedulerOutput

I64 = dict(dtype=torch.int64)


@dataclass
class StepPlan:
    inputs: dict
    # Sequences to sample, each with its row in the logits.
    sample: list[tuple[Sequence, int]] = field(default_factory=list)
    # Outputs at prompt positions: (sequence, the output, logits rows of the positions it takes now).
    prompt_rows: list[tuple[Sequence, PromptOutput, list[int]]] = field(default_factory=list)
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


_NO_TABLES = torch.empty((0, 1), dtype=torch.int32)  # the engine only reads its inputs


def _tables(block_tables: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    if not len(rows):
        return _NO_TABLES
    return block_tables[:, :max(width, 1)].index_select(0, rows)


def plan_step(out: SchedulerOutput, tokens_per_block: int, block_tables: torch.Tensor,
              sequence_lens: bool = False, lora_slots: bool = False) -> StepPlan:
    """sequence_lens, lora_slots: the engine takes each token's sequence length (LongRoPE) or adapter
    slot (LoRA) too (kiln/engine/format.py)."""
    tpb = tokens_per_block
    input_ids, positions, slots, lens, adapters = [], [], [], [], []
    ctx_index, ctx_rows, ctx_lens = [], [], []
    gen_index, gen_rows, gen_lens = [], [], []
    logits_index = []
    plan = StepPlan(inputs={})
    for seq, n in out.scheduled:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        first = len(input_ids)
        table = seq.block_table
        if sequence_lens:
            lens.extend([seq.num_tokens] * n)
        if lora_slots:
            adapters.extend([seq.request.lora_slot if seq.request.lora_request else -1] * n)
        if n == 1:
            input_ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(table[start // tpb] * tpb + start % tpb)
            gen_index.append(first)
            gen_rows.append(seq.row)
            gen_lens.append(start + 1)
        else:
            input_ids.extend((seq.token_ids + seq.draft_token_ids if seq.draft_token_ids else seq.token_ids)[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // tpb] * tpb + p % tpb for p in range(start, end))
            ctx_index.append(range(first, first + n))
            ctx_rows.append(seq.row)
            ctx_lens.append(end)
        for output in seq.request.prompt_outputs:
            lo, hi = max(start, output.next_position), min(end, output.end)
            if lo < hi:
                plan.prompt_rows.append((seq, output, list(range(len(logits_index), len(logits_index) + hi - lo))))
                logits_index.extend(range(first + lo - start, first + hi - start))
        if seq.draft_token_ids:  # the last token and every draft: the target's next-token rows
            plan.verify.append((seq, list(range(len(logits_index), len(logits_index) + n))))
            logits_index.extend(range(first, first + n))
        elif end == seq.num_tokens:
            plan.sample.append((seq, len(logits_index)))
            logits_index.append(first + n - 1)
    if not logits_index:
        logits_index.append(0)  # the graph returns at least one row; nobody reads it

    # Two host-to-tensor conversions per step (one per dtype), split into views: at batch 1 the
    # step's host time is mostly per-op overhead, paid again on caches the engine call just evicted.
    width = max((len(r) for r in ctx_index), default=1)
    ctx_tokens = [i for r in ctx_index for i in (*r, *[-1] * (width - len(r)))]
    sizes = (len(input_ids), len(positions), len(slots), len(gen_index), len(logits_index), len(lens), len(adapters),
             len(ctx_tokens), len(ctx_rows), len(gen_rows))
    ids, pos, slot_mapping, gen_token_index, logits, seq_lens, lora, ctx_token_index, ctx_table_rows, gen_table_rows = (
        torch.tensor(input_ids + positions + slots + gen_index + logits_index + lens + adapters + ctx_tokens + ctx_rows
                     + gen_rows, **I64).split_with_sizes(sizes))
    ctx_context_lens, gen_context_lens = torch.tensor(ctx_lens + gen_lens, dtype=torch.int32).split_with_sizes(
        (len(ctx_lens), len(gen_lens)))
    plan.inputs = dict(
        input_ids=ids,
        positions=pos,
        slot_mapping=slot_mapping,
        ctx_token_index=ctx_token_index.view(len(ctx_index), width),
        ctx_block_tables=_tables(block_tables, ctx_table_rows, -(-max(ctx_lens, default=1) // tpb)),
        ctx_context_lens=ctx_context_lens,
        gen_token_index=gen_token_index,
        gen_block_tables=_tables(block_tables, gen_table_rows, -(-max(gen_lens, default=1) // tpb)),
        gen_context_lens=gen_context_lens,
        logits_index=logits,
    )
    if sequence_lens:
        plan.inputs["sequence_lens"] = seq_lens
    if lora_slots:
        plan.inputs["lora_slots"] = lora
    return plan
