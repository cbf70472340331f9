"""The engine core: requests of token ids in, one step at a time, new token ids out.

It owns the scheduler, the KV cache manager, the executor (which runs the rank engines) and the
sampler, and knows nothing of text: tokenizing, detokenizing, stop strings and streaming belong to
the frontend (kiln/runtime/output_processor.py), which runs beside it in one process or talks to it
from another (kiln/runtime/core_client.py). A request ends here by EOS, a stop token id or its
length, or when the frontend aborts it (an abort, or a stop string the frontend found).

A pipeline-parallel engine under worker processes has up to pp_size steps in flight (a batch queue,
as vLLM v1's engine core keeps): step t + 1 is scheduled, from sequences not in step t, and
submitted before step t's logits are collected.
"""
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import torch

from kiln.runtime.executor import make_executor
from kiln.runtime.kv_cache_manager import KVCacheManager
from kiln.runtime.model_runner import StepPlan, plan_step
from kiln.runtime.sampler import SampleRow, Sampler, compute_prompt_logprobs, make_generator
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler, SchedulerOutput
from kiln.runtime.sequence import Request, Sequence
from kiln.runtime.spec_decode import SpeculativeConfig, make_proposer, verify
from kiln.runtime.stats import IterationStats
from kiln.runtime.threads import configure_threads


@dataclass
class EngineCoreRequest:
    """A request as the frontend sends it: validated, tokenized, its max_tokens bounded."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    cache_salt: str | None = None  # requests with different salts never share cached blocks


@dataclass
class SampleDelta:
    """What one sample of a request did this step."""
    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop" (EOS, a stop token id), "length", "abort"
    stop_reason: int | None = None  # the stop token id
    new_generation_logits: list[torch.Tensor] | None = None  # return_generation_logits: a row per token


@dataclass
class EngineCoreOutput:
    request_id: str
    samples: list[SampleDelta]
    new_prompt_logprobs: list[dict[int, float]] | None
    first_scheduled_time: float | None
    first_token_time: float | None
    finished: bool
    num_cached_tokens: int | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    context_logits: torch.Tensor | None = None  # return_context_logits: once the whole prompt is computed


@dataclass
class SchedulerStats:
    num_requests_running: int
    num_requests_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int = 0  # tokens, cumulative
    prefix_cache_hits: int = 0
    spec: "SpecStats | None" = None
    iterations: IterationStats | None = None


def stats_dict(stats: SchedulerStats) -> dict:
    """The stats as one flat dict (LLMEngine.get_stats, AsyncLLM.stats, the metrics exporters)."""
    d = asdict(stats)
    d.update(d.pop("iterations") or {})
    return d


@dataclass
class SpecStats:
    """Speculative decoding, cumulative (vLLM's spec_decode counters)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    # (request ids, message): a step failed; those requests are gone from the core.
    errors: list[tuple[list[str], str]] = field(default_factory=list)


@dataclass
class EngineInfo:
    """What the frontend needs to know of a loaded core to validate and tokenize requests."""
    build_config: object
    model_config: object
    max_batch_size: int
    max_num_tokens: int
    num_kv_blocks: int
    tokens_per_block: int
    scheduler_policy: str
    enable_chunked_prefill: bool
    threads: int
    enable_prefix_caching: bool


class EngineCore:
    def __init__(self, engine_dir, *, scheduler_policy: str = "max_utilization",
                 enable_chunked_prefill: bool = True, max_batch_size: int | None = None,
                 max_num_tokens: int | None = None, kv_cache_free_mem_fraction: float | None = None,
                 max_tokens_in_paged_kv_cache: int | None = None, threads: int | None = None,
                 enable_prefix_caching: bool = True, prefix_cache_seed: int | None = None,
                 speculative_config: dict | None = None):
        threads = configure_threads(threads)
        self.executor = make_executor(engine_dir, kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache, threads)
        build = self.executor.config.build_config
        self.build_config = build
        max_batch_size = _bounded("max_batch_size", max_batch_size, build.max_batch_size)
        self.kv = KVCacheManager(self.executor.num_blocks, build.tokens_per_block, max_batch_size,
                                 build.max_blocks_per_seq, enable_prefix_caching, prefix_cache_seed)
        self.scheduler = Scheduler(self.kv, max_batch_size, _bounded("max_num_tokens", max_num_tokens,
                                                                     build.max_num_tokens),
                                   build.max_seq_len, scheduler_policy, enable_chunked_prefill)
        self.sampler = Sampler()
        spec = SpeculativeConfig.from_dict(speculative_config)
        self.proposer = make_proposer(spec, engine_dir, self.executor.config, max_batch_size)
        self.num_speculative_tokens = spec.num_speculative_tokens if spec else 0
        self.spec_stats = SpecStats(accepted_per_pos=[0] * self.num_speculative_tokens) if spec else None
        self.iteration_stats = IterationStats()
        # Steps in flight at once: one per pipeline stage where the executor can overlap them (not
        # with a draft proposer, whose drafts need the previous step's tokens).
        self.batch_queue_size = 1 if self.proposer else getattr(self.executor, "max_concurrent_batches", 1)
        self.batch_queue: deque[tuple[SchedulerOutput, StepPlan, float]] = deque()
        self.requests: dict[str, Request] = {}
        self.info = EngineInfo(build, self.executor.config.pretrained_config, self.scheduler.max_batch_size,
                               self.scheduler.max_num_tokens, self.executor.num_blocks, build.tokens_per_block,
                               scheduler_policy, enable_chunked_prefill, threads, enable_prefix_caching)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, r: EngineCoreRequest) -> None:
        # The frontend only reuses an id it has finished (a stop string) that the core still runs.
        self.abort(r.request_id)
        req = Request(r.request_id, r.prompt_token_ids, r.params, r.max_tokens, r.eos_token_ids,
                      () if r.cache_salt is None else (r.cache_salt,), arrival_time=r.arrival_time,
                      forked=r.params.n == 1)
        if r.params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        req.sequences.append(self._new_sequence(req, 0, list(r.prompt_token_ids)))
        self.requests[r.request_id] = req
        self.scheduler.add(req)

    def _new_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seed = req.params.seed
        return Sequence(req, index, token_ids, generator=None if seed is None else make_generator(seed, index))

    def abort(self, request_id: str, index: int | None = None) -> None:
        """End the request, or only its sample `index` (a stop string the frontend found, which it
        can only have seen after the fork made the samples); their blocks go back to the pool.
        Unknown or finished ids are ignored."""
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.sequences:
            if (index is None or seq.index == index) and not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        if index is None:
            req.forked = True
        if req.finished:
            del self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.batch_queue)  # aborted requests' steps still to collect

    def shutdown(self) -> None:
        self.executor.shutdown()

    def stats(self) -> SchedulerStats:
        running = {s.request.request_id for s in self.scheduler.running}
        waiting = {s.request.request_id for s in self.scheduler.waiting} - running
        pool = self.kv.pool
        return SchedulerStats(len(running), len(waiting), pool.num_blocks, pool.num_free, pool.usage,
                              self.scheduler.num_preemptions, self.kv.queries, self.kv.hits, self.spec_stats,
                              self.iteration_stats)

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        if self.batch_queue_size > 1:
            return self._step_with_batch_queue()
        scheduled = self._schedule()
        if scheduled is None:
            return EngineCoreOutputs([], self.stats())
        out, plan, now = scheduled
        return self._process(out, plan, self.executor.execute(plan.inputs), now)

    def _step_with_batch_queue(self) -> EngineCoreOutputs:
        """Pipeline parallel: a step is submitted while up to pp_size - 1 others are still in the
        stages after the first, so that every stage works on one; each is scheduled from sequences
        not in flight, and the oldest is collected once the pipeline is full or nothing else fits."""
        if len(self.batch_queue) < self.batch_queue_size:
            # An even share of the batch per micro-batch: one step holding it all would leave the
            # other stages idle until it is back.
            active = min(len(self.scheduler.running) + len(self.scheduler.waiting), self.scheduler.max_batch_size)
            scheduled = self._schedule(max_seqs=-(-active // self.batch_queue_size))
            if scheduled is not None:
                for seq, _ in scheduled[0].scheduled:
                    seq.in_flight = True
                self.batch_queue.append(scheduled)
                self.executor.submit(scheduled[1].inputs)
                if len(self.batch_queue) < self.batch_queue_size:
                    return EngineCoreOutputs([], self.stats())
        if not self.batch_queue:
            return EngineCoreOutputs([], self.stats())
        out, plan, now = self.batch_queue.popleft()
        logits = self.executor.collect()
        for seq, _ in out.scheduled:
            seq.in_flight = False
        return self._process(out, plan, logits, now)

    def _schedule(self, max_seqs: int | None = None) -> tuple[SchedulerOutput, StepPlan, float] | None:
        if self.proposer is not None:
            self._propose()
        out = self.scheduler.schedule(max_seqs)
        if not out.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                seq = self.scheduler.waiting[0]
                raise RuntimeError(f"request {seq.request.request_id} cannot be scheduled: the KV cache "
                                   f"({self.kv.pool.num_blocks} blocks) cannot hold it")
            return None
        now = time.monotonic()
        self.iteration_stats.record(out, self.scheduler)
        return out, plan_step(out, self.build_config.tokens_per_block, self.kv.block_tables), now

    def _process(self, out: SchedulerOutput, plan: StepPlan, logits: torch.Tensor, now: float) -> EngineCoreOutputs:
        """The step's logits into tokens and outputs. A sequence aborted while its step was in
        flight is skipped: its blocks are already back in the pool."""
        touched: dict[str, tuple[Request, EngineCoreOutput]] = {}
        for seq, n in out.scheduled:
            if seq.finished:
                continue
            if not seq.draft_token_ids:  # a speculating one's count waits for the verification
                seq.num_computed_tokens += n
                self.kv.cache_full_blocks(seq)
            req = seq.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self._output(touched, req)
        for seq, first, rows in plan.prompt_rows:
            if seq.finished:
                continue
            req = seq.request
            targets = req.prompt_token_ids[first:first + len(rows)]
            new = compute_prompt_logprobs(logits[rows], targets, req.params.prompt_logprobs)
            req.prompt_logprobs.extend(new)
            self._output(touched, req).new_prompt_logprobs = new
        for seq, rows in plan.context_rows:
            if seq.finished:
                continue
            req = seq.request
            req.context_logits = logits[rows] if req.context_logits is None else torch.cat([req.context_logits,
                                                                                           logits[rows]])
            if len(req.context_logits) == req.num_prompt_tokens:
                self._output(touched, req).context_logits = req.context_logits
        self._sample([(seq, row) for seq, row in plan.sample if not seq.finished], logits, touched)
        self._verify(plan.verify, logits, touched)
        for req, o in touched.values():
            o.finished, o.first_token_time, o.num_cached_tokens = req.finished, req.first_token_time, req.num_cached_tokens
            o.num_draft_tokens, o.num_accepted_tokens = req.num_draft_tokens, req.num_accepted_tokens
        return EngineCoreOutputs([o for _, o in touched.values()], self.stats())

    @staticmethod
    def _output(touched: dict, req: Request) -> EngineCoreOutput:
        if req.request_id not in touched:
            touched[req.request_id] = req, EngineCoreOutput(req.request_id, [], None, req.first_scheduled_time,
                                                            None, False)
        return touched[req.request_id][1]

    def _sample(self, to_sample: list[tuple[Sequence, int]], logits: torch.Tensor, touched: dict) -> None:
        seqs, rows, copies = [], [], []
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
        self.executor.copy_blocks(copies)
        if not seqs:
            return
        # Every row in order (the common decode step): no gather copy of [rows, vocab] logits.
        picked = logits if rows == list(range(logits.shape[0])) else logits[rows]
        result = self.sampler(picked, [SampleRow(s.request.params, s.request.prompt_token_ids, s.output_token_ids,
                                                 s.generator, s.request.eos_token_ids) for s in seqs])
        for i, (seq, token) in enumerate(zip(seqs, result.token_ids)):
            lp = result.logprobs[i] if seq.request.params.logprobs is not None else None
            self._emit(seq, [token], None if lp is None else [lp], touched, picked[i:i + 1])

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list | None, touched: dict,
              logits: torch.Tensor) -> None:
        """Append a sequence's new tokens, up to the first that ends it."""
        req, now = seq.request, time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        sample = SampleDelta(seq.index, [], [] if logprobs is not None else None)
        if req.params.return_generation_logits:
            sample.new_generation_logits = []
        for j, token in enumerate(tokens):
            seq.token_ids.append(token)
            sample.new_token_ids.append(token)
            if logprobs is not None:
                sample.new_logprobs.append(logprobs[j])
            if sample.new_generation_logits is not None:
                sample.new_generation_logits.append(logits[j].clone())
            self._check_stop(seq, token, sample)
            if sample.finish_reason is not None:
                break
        self._output(touched, req).samples.append(sample)
        if seq.finished and req.finished:
            req.finished_time = now
            self.requests.pop(req.request_id, None)

    # -- speculative decoding --------------------------------------------------------------------
    def _propose(self) -> None:
        """Drafts for every decoding sequence, as many as its limits leave room for."""
        seqs, ks = [], []
        for seq in self.scheduler.running:
            seq.draft_token_ids = []
            req = seq.request
            if req.forked and not seq.prefilling:
                k = min(self.num_speculative_tokens, req.max_tokens - seq.num_output_tokens - 1,
                        self.build_config.max_seq_len - seq.num_tokens)
                if k > 0:
                    seqs.append(seq)
                    ks.append(k)
        self.proposer.prune({id(s) for s in self.scheduler.running})
        for seq, drafts in zip(seqs, self.proposer.propose(seqs, ks)):
            seq.draft_token_ids = drafts

    def _verify(self, to_verify: list[tuple[Sequence, list[int]]], logits: torch.Tensor, touched: dict) -> None:
        if not to_verify:
            return
        seqs = [seq for seq, _ in to_verify]
        rows = [r for _, rs in to_verify for r in rs]
        drafts = [seq.draft_token_ids for seq in seqs]
        results = verify(self.sampler, logits[rows], [
            SampleRow(s.request.params, s.request.prompt_token_ids, s.output_token_ids, s.generator,
                      s.request.eos_token_ids) for s in seqs], drafts)
        stats = self.spec_stats
        for (seq, rs), d, res in zip(to_verify, drafts, results):
            seq.draft_token_ids = []
            seq.num_computed_tokens += 1 + res.num_accepted  # K/V of rejected drafts is simply overwritten later
            self.kv.cache_full_blocks(seq)
            req = seq.request
            req.num_draft_tokens += len(d)
            req.num_accepted_tokens += res.num_accepted
            stats.num_drafts += 1
            stats.num_draft_tokens += len(d)
            stats.num_accepted_tokens += res.num_accepted
            for pos in range(res.num_accepted):
                stats.accepted_per_pos[pos] += 1
            self._emit(seq, res.token_ids, res.logprobs, touched, logits[rs])

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

    def _check_stop(self, seq: Sequence, token: int, sample: SampleDelta) -> None:
        req, params = seq.request, seq.request.params
        # Before min_tokens the sampler masks EOS and the stop token ids, so neither can end it early.
        if token in req.eos_token_ids and not params.ignore_eos:
            sample.finish_reason = "stop"
        elif token in params.stop_token_ids:
            sample.finish_reason, sample.stop_reason = "stop", token
        elif seq.num_output_tokens >= req.max_tokens or seq.num_tokens >= self.build_config.max_seq_len:
            sample.finish_reason = "length"
        if sample.finish_reason is not None:
            seq.finish_reason = sample.finish_reason
            self.scheduler.finish(seq)


def _bounded(name: str, value: int | None, limit: int) -> int:
    if value is None:
        return limit
    if not 1 <= value <= limit:
        raise ValueError(f"{name} must be in [1, {limit}] (the engine's build limit), got {value}")
    return value
