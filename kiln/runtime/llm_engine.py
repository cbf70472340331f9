"""The engine core every frontend shares: requests in, one step at a time, outputs back."""
import itertools
import time
from dataclasses import asdict

import torch

from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.engine import Engine
from kiln.runtime.kv_cache_manager import KVCacheManager
from kiln.runtime.model_runner import plan_step
from kiln.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kiln.runtime.sampler import SampleRow, Sampler, compute_prompt_logprobs, make_generator
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.sequence import Request, Sequence
from kiln.runtime.stats import IterationStats
from kiln.runtime.threads import configure_threads


def load_tokenizer(engine_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(engine_dir))


class LLMEngine:
    def __init__(self, engine_dir, *, scheduler_policy: str = "max_utilization",
                 enable_chunked_prefill: bool = True, max_batch_size: int | None = None,
                 max_num_tokens: int | None = None, kv_cache_free_mem_fraction: float | None = None,
                 max_tokens_in_paged_kv_cache: int | None = None, threads: int | None = None,
                 tokenizer=None):
        self.threads = configure_threads(threads)
        self.engine = Engine(engine_dir, kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache)
        build = self.engine.config.build_config
        self.build_config = build
        self.model_config = self.engine.config.pretrained_config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(engine_dir)
        self.max_batch_size = _bounded("max_batch_size", max_batch_size, build.max_batch_size)
        self.max_num_tokens = _bounded("max_num_tokens", max_num_tokens, build.max_num_tokens)
        self.kv = KVCacheManager(self.engine.num_blocks, build.tokens_per_block)
        self.scheduler = Scheduler(self.kv, self.max_batch_size, self.max_num_tokens, build.max_seq_len,
                                   scheduler_policy, enable_chunked_prefill)
        self.sampler = Sampler()
        self.iteration_stats = IterationStats()
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = self._eos_token_ids()
        self._ids = itertools.count()

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = self.model_config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(sorted(set(ids)))

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        build = self.build_config
        if len(token_ids) > build.max_input_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than the engine's max_input_len "
                             f"({build.max_input_len})")
        room = build.max_seq_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ValueError(f"max_tokens ({max_tokens}) + prompt ({len(token_ids)} tokens) exceeds the "
                             f"engine's max_seq_len ({build.max_seq_len})")
        if params.n > self.max_batch_size:
            raise ValueError(f"n ({params.n}) exceeds max_batch_size ({self.max_batch_size})")
        if not self.scheduler.enable_chunked_prefill and len(token_ids) > self.max_num_tokens:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_num_tokens "
                             f"({self.max_num_tokens}) allows without chunked prefill")
        if self.scheduler.policy == "guaranteed_no_evict":
            need, _ = self.kv.request_blocks(len(token_ids), len(token_ids) + max_tokens, params.n)
        else:  # samples may take turns (preemption), but the fork needs the prompt + n - 1 blocks at once
            need = max(self.kv.blocks_for(len(token_ids) + max_tokens),
                       self.kv.blocks_for(len(token_ids)) + params.n - 1)
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"prompt + max_tokens ({len(token_ids) + max_tokens} tokens, n={params.n}) does not "
                             f"fit in the KV cache ({self.kv.pool.num_blocks * build.tokens_per_block} tokens)")
        req = Request(request_id, text, token_ids, params, max_tokens, forked=params.n == 1)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        req.sequences.append(self._new_sequence(req, 0, list(token_ids)))
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of ints")
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary "
                                 f"[0, {self.model_config.vocab_size})")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids'; got {type(prompt).__name__}")

    def _new_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seed = req.params.seed
        return Sequence(req, index, token_ids,
                        generator=None if seed is None else make_generator(seed + index),
                        generation_logits=[] if req.params.return_generation_logits else None,
                        detokenizer=IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                           req.params.skip_special_tokens))

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return None
        req.forked = True
        for seq in req.sequences:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        req.finished_time = time.monotonic()
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> dict:
        """Load and KV occupancy now: requests running (any sample scheduled) and waiting, KV blocks;
        and the steps so far (IterationStats)."""
        running = {s.request.request_id for s in self.scheduler.running}
        waiting = {s.request.request_id for s in self.scheduler.waiting} - running
        pool = self.kv.pool
        return dict(num_requests_running=len(running), num_requests_waiting=len(waiting),
                    num_kv_blocks=pool.num_blocks, num_free_kv_blocks=pool.num_free,
                    kv_cache_usage=pool.usage, num_preemptions=self.scheduler.num_preemptions,
                    **asdict(self.iteration_stats))

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.scheduler.running or not self.scheduler.waiting:
                return []
            seq = self.scheduler.waiting[0]
            raise RuntimeError(f"request {seq.request.request_id} cannot be scheduled: the KV cache "
                               f"({self.kv.pool.num_blocks} blocks) cannot hold it")
        now = time.monotonic()
        self.iteration_stats.record(out, self.scheduler)
        plan = plan_step(out, self.build_config.tokens_per_block)
        logits = self.engine(plan.inputs)
        touched = {}
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            touched[seq.request.request_id] = seq.request
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
        for seq, first, rows in plan.prompt_rows:
            req = seq.request
            targets = req.prompt_token_ids[first:first + len(rows)]
            req.prompt_logprobs.extend(compute_prompt_logprobs(logits[rows], targets, req.params.prompt_logprobs))
        for seq, rows in plan.context_rows:
            req = seq.request
            done = logits[rows]
            req.context_logits = done if req.context_logits is None else torch.cat([req.context_logits, done])
        self._sample(plan.sample, logits)
        return [self._output(req) for req in touched.values()]

    def _sample(self, to_sample: list[tuple[Sequence, int]], logits: torch.Tensor) -> None:
        seqs, rows = [], []
        copies = []
        for seq, row in to_sample:
            req = seq.request
            if not req.forked:
                copies.extend(self._fork(seq))
                for s in req.sequences:
                    seqs.append(s)
                    rows.append(row)
            else:
                seqs.append(seq)
                rows.append(row)
        self.engine.copy_blocks(copies)
        if not seqs:
            return
        # Every row in order (the common decode step): no gather copy of [rows, vocab] logits.
        picked = logits if rows == list(range(logits.shape[0])) else logits[rows]
        result = self.sampler(picked, [
            SampleRow(s.request.params, s.request.prompt_token_ids, s.output_token_ids, s.generator,
                      self.eos_token_ids) for s in seqs])
        now = time.monotonic()
        for i, (seq, token) in enumerate(zip(seqs, result.token_ids)):
            req = seq.request
            if req.first_token_time is None:
                req.first_token_time = now
            seq.token_ids.append(token)
            if seq.generation_logits is not None:
                seq.generation_logits.append(picked[i].clone())
            if req.params.logprobs is not None:
                lp = result.logprobs[i]
                seq.logprobs.append(lp)
                seq.cumulative_logprob += lp[token]
            self._check_stop(seq, token)
            if seq.finished and req.finished:
                req.finished_time = now
                self.requests.pop(req.request_id, None)

    def _fork(self, parent: Sequence) -> list[tuple[int, int]]:
        """The prompt is computed: make the request's other n - 1 samples, sharing its KV blocks."""
        req = parent.request
        copies = []
        # guaranteed_no_evict: each sample takes its own share of the request's reservation.
        per_child = self.kv.request_blocks(req.num_prompt_tokens, req.max_len, req.params.n)[1] \
            if parent.reserved_blocks else 0
        children = []
        for index in range(1, req.params.n):
            child = self._new_sequence(req, index, list(parent.token_ids))
            child.num_computed_tokens = parent.num_computed_tokens
            if per_child:
                parent.reserved_blocks -= per_child
                child.reserved_blocks = per_child
            pair = self.kv.fork(parent, child)
            if pair:
                copies.append(pair)
            children.append(child)
        req.sequences.extend(children)
        self.scheduler.add_forked(children)
        req.forked = True
        return copies

    def _check_stop(self, seq: Sequence, token: int) -> None:
        req, params = seq.request, seq.request.params
        delta = seq.detokenizer.add(token)
        if token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif params.stop and delta and seq.num_output_tokens > params.min_tokens:
            self._check_stop_strings(seq, delta)
        if seq.finish_reason is None and (seq.num_output_tokens >= req.max_tokens
                                          or seq.num_tokens >= self.build_config.max_seq_len):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            if not isinstance(seq.stop_reason, str):  # a stop string has already cut the text
                seq.detokenizer.flush()
            self.scheduler.finish(seq)

    def _check_stop_strings(self, seq: Sequence, delta: str) -> None:
        text = seq.detokenizer.text
        longest = max(len(s) for s in seq.request.params.stop)
        window_start = max(0, len(text) - len(delta) - longest + 1)
        hits = [(text.find(s, window_start), s) for s in seq.request.params.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if hits:
            pos, stop = min(hits)
            end = pos + len(stop) if seq.request.params.include_stop_str_in_output else pos
            seq.detokenizer.text = text[:end]
            seq.finish_reason, seq.stop_reason = "stop", stop

    def _output(self, req: Request) -> RequestOutput:
        outputs = [CompletionOutput(
            index=s.index, text=s.detokenizer.text, token_ids=list(s.output_token_ids),
            cumulative_logprob=s.cumulative_logprob if req.params.logprobs is not None else None,
            logprobs=list(s.logprobs) if req.params.logprobs is not None else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            generation_logits=None if s.generation_logits is None else list(s.generation_logits))
            for s in req.sequences]
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                 req.finished_time, max((s.num_output_tokens for s in req.sequences), default=0))
        context = req.context_logits
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids),
                             None if req.prompt_logprobs is None else list(req.prompt_logprobs),
                             outputs, req.finished, metrics,
                             context if context is not None and len(context) == req.num_prompt_tokens else None)


def _bounded(name: str, value: int | None, limit: int) -> int:
    if value is None:
        return limit
    if not 1 <= value <= limit:
        raise ValueError(f"{name} must be in [1, {limit}] (the engine's build limit), got {value}")
    return value
