"""Guided decoding in the engine core: grammars compiled off the step, a matcher per guided sequence,
and the token bitmask of every guided row a step samples or verifies (xgrammar, as TensorRT-LLM and
vLLM use it).

- A guided request waits outside the scheduler until its grammar is compiled, on a thread of its
  own: the step loop never waits for a compilation while it has other work. xgrammar's compiler
  keeps what it compiled (an LRU bounded in bytes), so each distinct guide compiles once.
- Each guided sequence holds a ``GrammarMatcher`` that advances on the tokens it emits (n > 1
  samples fork with fresh ones: they have emitted nothing yet). A preempted sequence keeps its
  matcher: recomputing its K/V changes none of its tokens.
- The bitmasks of a step are filled, on a thread while the engine computes the step's logits where
  a core is free for it (xgrammar releases the GIL), else before the step: one row per sampled
  guided sequence and, for a speculating one, one per draft position (the drafts are accepted into
  the matcher to fill the next position's row, then rolled back; the verification then accepts
  what it emits).

Tokenizing belongs to the frontend, but a grammar compiles against the token strings: the manager
loads the engine's tokenizer (once, on the first guided request).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from kiln.runtime.core.request import Request, Sequence
from kiln.runtime.sampling_params import GuidedDecodingParams

# The compiled grammars xgrammar keeps (least recently used dropped first).
CACHE_BYTES = 256 << 20


class StructuredOutputManager:
    """overlap: fill the bitmasks on a thread of their own while the engine computes the step, where a
    core is left for it; where the engine's threads take every core, a third thread only slows the
    step's kernels down (measured on 2 cores: batch-16 guided decode at 0.93x of unguided with it,
    0.95-0.96x filling before the step, benchmarks/guided.py)."""

    def __init__(self, engine_dir, vocab_size: int, overlap: bool = True):
        self.engine_dir, self.vocab_size, self.overlap = Path(engine_dir), vocab_size, overlap
        self._compiler = None
        self._threads = ThreadPoolExecutor(1, thread_name_prefix="kiln-grammar")
        self.waiting: list[Request] = []  # compiling: not yet in the scheduler

    # -- grammars ------------------------------------------------------------------------------
    def compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            if not any(self.engine_dir.glob("tokenizer*")):
                raise ValueError(f"guided decoding compiles grammars against the engine's tokenizer, and "
                                 f"{self.engine_dir} has none (engine-build --tokenizer_dir)")
            tokenizer = AutoTokenizer.from_pretrained(self.engine_dir)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=CACHE_BYTES)
        return self._compiler

    def compile(self, guide: GuidedDecodingParams):
        """The compiled grammar of a guide (from xgrammar's cache after the first time)."""
        compiler = self.compiler()
        if guide.kind in ("json", "json_object"):  # keyed by the schema text in xgrammar's cache
            schema = guide.json if guide.kind == "json" else '{"type": "object"}'
            return compiler.compile_json_schema(schema, any_whitespace=not guide.disable_any_whitespace)
        if guide.kind == "regex":
            return compiler.compile_regex(guide.regex)
        return compiler.compile_grammar(guide.to_grammar())

    def add(self, req: Request) -> None:
        """Start compiling a guided request's grammar; it waits here until `admit` hands it on."""
        req.grammar = self._threads.submit(self.compile, req.params.guided_decoding)
        self.waiting.append(req)

    def admit(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The waiting requests whose grammar is ready, each sequence given its matcher, and those
        whose grammar failed to compile, with the reason."""
        ready, failed, still = [], [], []
        for req in self.waiting:
            if req.finished:
                continue  # aborted while compiling
            if not req.grammar.done():
                still.append(req)
            elif req.grammar.exception() is not None:
                e = req.grammar.exception()
                failed.append((req, f"guided_decoding.{req.params.guided_decoding.kind}: {e}"))
            else:
                for seq in req.sequences:
                    seq.matcher = self.matcher(req)
                ready.append(req)
        self.waiting = still
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a waiting grammar is compiled (or timeout seconds): the core has nothing else."""
        from concurrent.futures import FIRST_COMPLETED, wait

        if self.waiting:
            wait([r.grammar for r in self.waiting], timeout=timeout, return_when=FIRST_COMPLETED)

    def matcher(self, req: Request):
        import xgrammar as xgr

        stops = list(dict.fromkeys([*req.eos_token_ids, *req.params.stop_token_ids])) or None
        return xgr.GrammarMatcher(req.grammar.result(), override_stop_tokens=stops)

    # -- bitmasks ------------------------------------------------------------------------------
    def fill_async(self, sampled: list[Sequence], verified: list[Sequence]) -> Future | None:
        """Start filling the bitmasks of a step's guided rows (see fill); None when it has none."""
        sampled = [s for s in sampled if s.matcher is not None]
        verified = [s for s in verified if s.matcher is not None]
        if not sampled and not verified:
            return None
        if not self.overlap:
            done = Future()
            done.set_result(self.fill(sampled, verified))
            return done
        return self._threads.submit(self.fill, sampled, verified)

    def fill(self, sampled: list[Sequence], verified: list[Sequence]) -> dict[Sequence, list[torch.Tensor]]:
        """Per guided sequence, the bitmask of each position it is sampled at: [W] int32 rows, bit
        t % 32 of word t // 32 set where token t is allowed. A speculating sequence has one per
        draft position and the bonus one; a position after a draft the grammar refuses is never
        reached (the draft is rejected there) and allows everything."""
        import xgrammar as xgr

        rows = len(sampled) + sum(len(s.draft_token_ids) + 1 for s in verified)
        bitmask = xgr.allocate_token_bitmask(rows, self.vocab_size)
        out, r = {}, 0
        for seq in sampled:
            if not seq.matcher.is_terminated():  # ended (ignore_eos went past its end): anything goes
                seq.matcher.fill_next_token_bitmask(bitmask, r)
            out[seq] = [bitmask[r]]
            r += 1
        for seq in verified:
            m, taken, out[seq] = seq.matcher, 0, []
            for j, draft in enumerate([*seq.draft_token_ids, None]):
                m.fill_next_token_bitmask(bitmask, r + j)
                out[seq].append(bitmask[r + j])
                if draft is None or not m.accept_token(draft):
                    break
                taken += 1
            if taken:
                m.rollback(taken)
            out[seq] += [bitmask[r + j] for j in range(len(out[seq]), len(seq.draft_token_ids) + 1)]
            r += len(seq.draft_token_ids) + 1
        return out

    @staticmethod
    def accept(seq: Sequence, token: int) -> None:
        if seq.matcher is not None and not seq.matcher.is_terminated():
            seq.matcher.accept_token(token)

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
