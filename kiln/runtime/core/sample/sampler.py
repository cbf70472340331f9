"""The engine core's sampler: a batch of logits rows and their SampleRows in, a token per row out,
with vLLM's semantics (the spec: torch_sampler.py).

It runs the kiln_cpp library's sampler (kiln/plugins/csrc/sampler.cpp: one call a batch, a few
passes a row, no sort of the vocabulary, top-p by rejection sampling, so its seeded draws differ
from the spec's wherever top-p cuts) when the library loads and the logits are on the CPU,
``TorchSampler`` otherwise. For the C++ op the rows are packed into its tensors (per-row
parameters, the tokens each penalized row has seen, the tokens min_tokens bans) and its outputs
unpacked into a SampleOutput. Packing costs O(rows + penalized tokens) of Python per step: flat
lists, then one struct.pack each into a buffer the tensor wraps (4x faster than array.extend, 10x
than torch.tensor).
"""
from __future__ import annotations

import functools
import os
import struct
import warnings
from typing import Sequence

import torch

from kiln.plugins import cpp
from kiln.runtime.core.sample.rows import SampleOutput, SampleRow, call_key, completing_bad_words, draw_stream
from kiln.runtime.core.sample.torch_sampler import TorchSampler

BACKENDS = ("auto", "cpp", "torch")
_cpp_unavailable: str | None = None  # why the C++ sampler cannot load here, once known


def _cpp_loads() -> bool:
    global _cpp_unavailable
    if _cpp_unavailable is None:
        try:
            cpp.load()
            _cpp_unavailable = ""
        except cpp.PluginBuildError as e:
            _cpp_unavailable = str(e)
            warnings.warn(f"kiln: the C++ sampler is unavailable, sampling with torch ops instead: {e}",
                          RuntimeWarning, stacklevel=4)
    return not _cpp_unavailable


class Sampler:
    """``Sampler(backend)(logits [N, V], rows) -> SampleOutput``, the spec of torch_sampler.py. Does not modify
    ``logits``. backend: "cpp" (kiln_cpp's sampler; CPU logits), "torch" (``TorchSampler``), or
    "auto" (the default, or $KILN_SAMPLER): cpp for CPU logits where the library builds and loads
    (built once, by `make install` or on first use), torch otherwise, with a warning saying why."""

    def __init__(self, backend: str | None = None):
        backend = backend or os.environ.get("KILN_SAMPLER") or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"sampler backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if backend == "cpp":
            cpp.load()  # a PluginBuildError says why not
        self.backend = backend
        self.reference = TorchSampler()

    def _use_cpp(self, logits: torch.Tensor) -> bool:
        if self.backend == "torch":
            return False
        if logits.device.type != "cpu":
            if self.backend == "cpp":
                raise ValueError(f"the cpp sampler takes CPU logits, got logits on {logits.device}")
            return False
        return self.backend == "cpp" or _cpp_loads()

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleOutput:
        if not self._use_cpp(logits):
            return self.reference(logits, rows)
        return cpp_sample(logits, rows)

    def process_logits(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """The logits after min_tokens masking and the penalties (steps 1-3), as a new float32
        tensor: what greedy rows take the argmax of, before temperature/top-k/top-p/min-p."""
        if not self._use_cpp(logits):
            return self.reference.process_logits(logits, rows)
        return cpp_process_logits(logits, rows)


_M64 = (1 << 64) - 1


def _int64(x: int) -> int:
    """x mod 2^64 as a signed int64 (the kernel reads the bits back as uint64)."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def _tensor(values: list, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    if not values:
        return torch.empty(0, dtype=dtype)
    buf = bytearray(len(values) * struct.calcsize(fmt))
    struct.pack_into(f"{len(values)}{fmt}", buf, 0, *values)
    return torch.frombuffer(buf, dtype=dtype)


def _pack(logits: torch.Tensor, rows: Sequence[SampleRow]):
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got shape {tuple(logits.shape)}")
    N, V = logits.shape
    raw = logits if logits.dtype == torch.float32 else logits.float()
    if raw.stride(1) != 1:
        raw = raw.contiguous()
    fp, ip = [], []
    history, history_offsets = [], [0]
    banned, banned_offsets = [], [0]
    key = call_key(rows)
    for j, r in enumerate(rows):
        p = r.params
        out = r.output_token_ids
        greedy = p.greedy
        seed, stream = (0, 0) if greedy else draw_stream(r, j, key)
        fp += (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        ip += (greedy, p.top_k, -1 if p.logprobs is None else p.logprobs, _int64(seed), _int64(stream), len(out))
        if p.uses_penalties:
            if p.repetition_penalty != 1.0:
                history += r.prompt_token_ids
            history_offsets.append(len(history))
            history += out
        else:
            history_offsets.append(len(history))
        history_offsets.append(len(history))
        if p.min_tokens and len(out) < p.min_tokens:
            ids = set(p.stop_token_ids)
            if not p.ignore_eos:
                ids.update(r.eos_token_ids)
            banned += (t for t in ids if 0 <= t < V)
        if p.bad_words_ids:
            banned += completing_bad_words(p.bad_words_ids, r.prompt_token_ids, out, V)
        banned_offsets.append(len(banned))
    return (raw, _tensor(fp, "f", torch.float32).view(N, 6), _tensor(ip, "q", torch.int64).view(N, 6),
            _tensor(history, "q", torch.int64), _tensor(history_offsets, "q", torch.int64),
            _tensor(banned, "q", torch.int64), _tensor(banned_offsets, "q", torch.int64))


def _allowed(rows: Sequence[SampleRow], V: int) -> torch.Tensor | None:
    """The rows' grammar bitmasks as one [N, ceil(V / 32)] int32 tensor (-1: every token), or None
    when no row is guided."""
    if all(r.allowed is None for r in rows):
        return None
    out = torch.full((len(rows), (V + 31) // 32), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        if r.allowed is not None:
            out[i] = r.allowed
    return out


@functools.lru_cache(maxsize=64)
def _argmax_args(n: int) -> tuple[torch.Tensor, ...]:
    """The sample op's packed rows for n rows of _argmax_of_raw, the same every step: nothing to pack
    (not torch.argmax, whose OpenMP team would then spin against the kernels' pool)."""
    fp = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0, 0.0]] * n)  # temperature, top_p, min_p, the penalties: off
    ip = torch.tensor([[1, 0, -1, 0, 0, 0]] * n)  # greedy, no top-k, no logprobs
    none, offsets = torch.empty(0, dtype=torch.int64), torch.zeros(2 * n + 1, dtype=torch.int64)
    return fp, ip, none, offsets, none, offsets[:n + 1]


def _argmax_of_raw(rows: Sequence[SampleRow]) -> bool:
    """Whether every row's token is the argmax of its raw logits: greedy rows that nothing masks or
    penalizes and that want no logprobs (most decode batches of a benchmark or an eval)."""
    for r in rows:
        p = r.params
        if not p.greedy or p.logprobs is not None or p.uses_penalties or p.bad_words_ids or r.allowed is not None \
                or len(r.output_token_ids) < p.min_tokens:
            return False
    return True


def cpp_sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleOutput:
    if logits.dim() == 2 and logits.shape[0] == 0 == len(rows):
        return SampleOutput([], [], [])
    if logits.dim() == 2 and logits.shape[0] == len(rows) and _argmax_of_raw(rows):
        raw = logits if logits.dtype == torch.float32 and logits.stride(1) == 1 else logits.float().contiguous()
        tokens = torch.ops.kiln_cpp.sample(raw, *_argmax_args(len(rows)), 0, None)[0]
        return SampleOutput(tokens.tolist(), [None] * len(rows), [None] * len(rows))
    args = _pack(logits, rows)
    wanted = [r.params.logprobs for r in rows]
    max_n = max((n for n in wanted if n is not None), default=0)
    tokens, chosen, ranks, top_ids, top_lp = torch.ops.kiln_cpp.sample(*args, max_n, _allowed(rows, logits.shape[1]))
    token_ids = tokens.tolist()
    logprobs: list[dict[int, float] | None] = [None] * len(rows)
    rank_list: list[int | None] = [None] * len(rows)
    if any(n is not None for n in wanted):
        chosen_l, ranks_l, ids_l, lp_l = chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist()
        for r, n in enumerate(wanted):
            if n is None:
                continue
            d = {token_ids[r]: chosen_l[r]}
            for t, v in zip(ids_l[r][:n], lp_l[r][:n]):
                d.setdefault(t, v)
            logprobs[r] = d
            rank_list[r] = ranks_l[r]
    return SampleOutput(token_ids, logprobs, rank_list)


def cpp_process_logits(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    return torch.ops.kiln_cpp.process_logits(*_pack(logits, rows), _allowed(rows, logits.shape[1]))
