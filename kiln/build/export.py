"""`torch.export` of one rank's model with dynamic shapes bounded by the build config."""
import torch
from torch.export import Dim

from kiln.config import BuildConfig, PretrainedConfig, torch_dtype
from kiln.engine.format import (HIDDEN_STATES, LORA_POOLS, LORA_RANKS, LORA_SLOTS, OP_LIBRARIES, SEQUENCE_LENS,
                               kv_cache_dtype, lora_pool_shapes, op_libraries)


def example_inputs(pretrained: PretrainedConfig, build: BuildConfig, num_blocks: int = 16, rank: int = 0):
    """A small mixed step (2 context chunks + 3 decodes) with every dynamic size distinct and > 1,
    so that export neither specializes a size nor infers equalities that do not hold; for rank
    `rank`, whose pipeline stage may start from hidden states."""
    bs = build.tokens_per_block
    ctx_q, num_ctx, num_gen = 3, 2, 3
    T = ctx_q * num_ctx + num_gen
    i32 = dict(dtype=torch.int32)
    ctx_token_index = torch.arange(num_ctx * ctx_q, **i32).view(num_ctx, ctx_q)
    pp_rank = pretrained.mapping.pp_rank(rank)
    kv = torch.zeros(len(pretrained.layers_of(pp_rank)), 2, num_blocks, bs, pretrained.kv_heads_per_rank,
                     pretrained.head_size, dtype=kv_cache_dtype(pretrained, build))
    inputs = dict(
        input_ids=torch.arange(T, dtype=torch.int64) % pretrained.vocab_size,
        positions=torch.arange(T, dtype=torch.int64),
        slot_mapping=torch.arange(T, dtype=torch.int64),
        ctx_token_index=ctx_token_index.long(),
        ctx_block_tables=torch.zeros(num_ctx, 4, **i32),
        ctx_context_lens=torch.full((num_ctx,), ctx_q, **i32),
        gen_token_index=torch.arange(num_ctx * ctx_q, T, dtype=torch.int64),
        gen_block_tables=torch.ones(num_gen, 5, **i32),
        gen_context_lens=torch.full((num_gen,), 2, **i32),
        logits_index=torch.arange(T - 5, T, dtype=torch.int64),
        kv_cache=kv,
    )
    if pp_rank > 0:
        inputs[HIDDEN_STATES] = torch.randn(T, pretrained.hidden_size).to(torch_dtype(pretrained.dtype))
    if pretrained.long_rope_threshold:
        inputs[SEQUENCE_LENS] = torch.full((T,), 7, dtype=torch.int64)
    if build.lora_config is not None:
        inputs[LORA_SLOTS] = torch.arange(T, dtype=torch.int64) % 4 - 1  # slots 0..2, and -1: the base model
        inputs[LORA_RANKS] = torch.tensor([build.lora_config["max_lora_rank"], 1, 0], dtype=torch.int64)
        inputs[LORA_POOLS] = {m: torch.zeros(shape, dtype=torch_dtype(pretrained.dtype))
                              for m, shape in lora_pool_shapes(pretrained, build, rank, 3).items()}
    return inputs


def dynamic_shapes(build: BuildConfig, inputs: dict):
    def dim(name, lo, hi, example):
        # Up to the build's limit, or the example's size where that is larger: a build for batch 1
        # still traces the 3-decode example (the runtime never sends more than the build's limits).
        return Dim(name, min=lo, max=max(hi, example, 2))

    def size(name, axis):
        return inputs[name].shape[axis]

    T = dim("num_tokens", 1, build.max_num_tokens, size("input_ids", 0))
    Sc = dim("num_ctx", 0, build.max_batch_size, size("ctx_token_index", 0))
    Sg = dim("num_gen", 0, build.max_batch_size, size("gen_token_index", 0))
    Q = dim("max_ctx_tokens", 1, build.max_num_tokens, size("ctx_token_index", 1))
    MBc = dim("ctx_blocks", 1, build.max_blocks_per_seq, size("ctx_block_tables", 1))
    MBg = dim("gen_blocks", 1, build.max_blocks_per_seq, size("gen_block_tables", 1))
    N = dim("num_logits", 1, build.max_num_tokens, size("logits_index", 0))
    blocks = Dim("num_blocks", min=2, max=1 << 24)
    optional = {name: {0: T} for name in (HIDDEN_STATES, SEQUENCE_LENS, LORA_SLOTS) if name in inputs}
    if LORA_POOLS in inputs:
        slots = Dim("max_loras", min=1, max=1 << 12)
        optional[LORA_POOLS] = {m: {1: slots} for m in inputs[LORA_POOLS]}
        optional[LORA_RANKS] = {0: slots}
    return dict(
        input_ids={0: T}, positions={0: T}, slot_mapping={0: T},
        ctx_token_index={0: Sc, 1: Q}, ctx_block_tables={0: Sc, 1: MBc}, ctx_context_lens={0: Sc},
        gen_token_index={0: Sg}, gen_block_tables={0: Sg, 1: MBg}, gen_context_lens={0: Sg},
        logits_index={0: N}, kv_cache={2: blocks}, **optional,
    )


def export(model: torch.nn.Module, pretrained: PretrainedConfig, build: BuildConfig, rank: int = 0):
    inputs = example_inputs(pretrained, build, rank=rank)
    with torch.no_grad():
        program = torch.export.export(model, (), inputs, dynamic_shapes=dynamic_shapes(build, inputs), strict=False)
    check_op_libraries(program, pretrained, build)
    return program


def check_op_libraries(program, pretrained: PretrainedConfig, build: BuildConfig) -> None:
    """The graph calls no op library that op_libraries does not name for its config: the runtime
    registers those, and only those, before it deserializes the engine."""
    named = set(op_libraries(pretrained, build))
    calls = {f"{node.target.namespace}::{node.target._opname}" for node in program.graph.nodes
             if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
             and node.target.namespace in OP_LIBRARIES and node.target.namespace not in named}
    if calls:
        raise RuntimeError(f"the engine calls {', '.join(sorted(calls))}, from a library that "
                           f"kiln.engine.format.op_libraries does not name for its config: a loading process "
                           f"would not register it")
