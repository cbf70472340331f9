"""Turns a scheduled step into the engine's flat input tensors (DESIGN.md, "The engine step")."""
from dataclasses import dataclass, field

import torch

from kiln.runtime.scheduler import SchedulerOutput
from kiln.runtime.sequence import Sequence


@dataclass
class StepPlan:
    inputs: dict
    # Sequences to sample, each with its row in the logits.
    sample: list[tuple[Sequence, int]] = field(default_factory=list)
    # Prompt logprobs: (sequence, first prompt position predicted, logits rows).
    prompt_rows: list[tuple[Sequence, int, list[int]]] = field(default_factory=list)
    # return_context_logits: (sequence, logits rows of the prompt positions it computes this step).
    context_rows: list[tuple[Sequence, list[int]]] = field(default_factory=list)


def _pad(rows: list[list[int]], value: int, min_width: int = 1) -> torch.Tensor:
    width = max([len(r) for r in rows] + [min_width])
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.int64).view(len(rows), width)


def plan_step(out: SchedulerOutput, tokens_per_block: int) -> StepPlan:
    input_ids, positions, slots = [], [], []
    ctx_index, ctx_tables, ctx_lens = [], [], []
    gen_index, gen_tables, gen_lens = [], [], []
    logits_index = []
    plan = StepPlan(inputs={})
    for seq, n in out.scheduled:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        first = len(input_ids)
        flat = list(range(first, first + n))
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // tokens_per_block] * tokens_per_block + p % tokens_per_block
                     for p in range(start, end))
        used_blocks = table[: -(-end // tokens_per_block)]
        if n == 1:
            gen_index.append(first)
            gen_tables.append(used_blocks)
            gen_lens.append(end)
        else:
            ctx_index.append(flat)
            ctx_tables.append(used_blocks)
            ctx_lens.append(end)
        req = seq.request
        if req.prompt_logprobs is not None:
            # Logits at position p predict prompt token p + 1; after a preemption the positions
            # already scored are not scored again.
            lo, hi = max(start, len(req.prompt_logprobs) - 1), min(end, req.num_prompt_tokens - 1)
            if lo < hi:
                plan.prompt_rows.append((seq, lo + 1, list(range(len(logits_index), len(logits_index) + hi - lo))))
                logits_index.extend(flat[lo - start: hi - start])
        if req.params.return_context_logits:
            done = 0 if req.context_logits is None else len(req.context_logits)
            lo, hi = max(start, done), min(end, req.num_prompt_tokens)
            if lo < hi:
                plan.context_rows.append((seq, list(range(len(logits_index), len(logits_index) + hi - lo))))
                logits_index.extend(flat[lo - start: hi - start])
        if end == seq.num_tokens:
            plan.sample.append((seq, len(logits_index)))
            logits_index.append(flat[-1])
    if not logits_index:
        logits_index.append(0)  # the graph returns at least one row; nobody reads it
    i64 = dict(dtype=torch.int64)
    i32 = dict(dtype=torch.int32)
    plan.inputs = dict(
        input_ids=torch.tensor(input_ids, **i64),
        positions=torch.tensor(positions, **i64),
        slot_mapping=torch.tensor(slots, **i64),
        ctx_token_index=_pad(ctx_index, -1),
        ctx_block_tables=_pad(ctx_tables, 0).to(torch.int32),
        ctx_context_lens=torch.tensor(ctx_lens, **i32),
        gen_token_index=torch.tensor(gen_index, **i64),
        gen_block_tables=_pad(gen_tables, 0).to(torch.int32),
        gen_context_lens=torch.tensor(gen_lens, **i32),
        logits_index=torch.tensor(logits_index, **i64),
    )
    return plan
