"""The engine core: requests of token ids in, one step at a time, new token ids out.

It owns the scheduler, the KV cache manager, the executor (which runs the rank engines), the
sampler and, when asked for, speculative decoding, and knows nothing of text: tokenizing,
detokenizing, stop strings and streaming belong to the frontend (kiln/runtime/frontend/), which
runs it in its own thread or talks to `run_engine_core`, its busy loop in a process of its own. What
the two say to each other is in kiln/runtime/messages.py. A request ends here by EOS, a stop token
id or its length, or when the frontend aborts it (an abort, or a stop string the frontend found).

Each step reads schedule -> plan -> execute -> sample -> emit. How a request's sequences are made
(n > 1 samples forked from one prompt, a beam search's beams) is its group's policy
(request_group.py); the core's own process loop is core_process.py.

A pipeline-parallel engine under worker processes has up to pp_size steps in flight (a batch queue,
as vLLM v1's engine core keeps): step t + 1 is scheduled, from sequences not in step t, and
submitted before step t's logits are collected.
"""
import atexit
import gc
import os
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kiln.lora.slots import LoraSlots
from kiln.runtime.core.beam_search import BeamSearch
from kiln.runtime.core.kv_cache_manager import KVCacheManager
from kiln.runtime.core.parallel_sampling import ParallelSampling
from kiln.runtime.core.request import Request, Sequence
from kiln.runtime.core.request_group import RequestGroup
from kiln.runtime.core.sample.rows import SampleRow, make_generator
from kiln.runtime.core.sample.sampler import Sampler
from kiln.runtime.core.scheduler import Scheduler, SchedulerOutput
from kiln.runtime.core.spec_decode import SpecDecoder
from kiln.runtime.core.step_plan import StepPlan, plan_step
from kiln.runtime.core.structured_output import StructuredOutputManager
from kiln.runtime.executor.factory import make_executor
from kiln.runtime.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineInfo,
                                   IterationStats, SampleDelta, SchedulerStats)
from kiln.runtime.sampling_params import SamplingParams
from kiln.threads import available_cpus, configure_threads

PROFILE_MAX_TOKENS = 256  # past this, a step's cost is taken as linear in its tokens


@dataclass
class ScheduledStep:
    out: SchedulerOutput
    plan: StepPlan
    time: float
    masks: Future | None = None  # its guided rows' bitmasks, being filled (structured_output.py)


class BatchQueue:
    """The steps submitted and not yet collected, oldest first, and the sequences they hold."""

    def __init__(self, size: int):
        self.size = size
        self.steps: deque[ScheduledStep] = deque()
        self.in_flight: set[Sequence] = set()

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):
        return iter(self.steps)

    def push(self, step: ScheduledStep) -> None:
        self.steps.append(step)
        self.in_flight.update(seq for seq, _ in step.out.scheduled)

    def pop(self) -> ScheduledStep:
        step = self.steps.popleft()
        self.in_flight.difference_update(seq for seq, _ in step.out.scheduled)
        return step


def _freeze_heap() -> None:
    """What startup built (torch's modules, the engine, the tokenizer) lives until the process ends:
    frozen out of the garbage collector, whose full passes would walk all of it between steps (5% of
    a batch-16 decode step), as vLLM freezes its heap after startup. Frozen cyclic garbage is never
    collected: an engine's shutdown and the next engine's start unfreeze it (a process that drops
    and loads engines, Triton's reloads, frees the old ones), as does exit, so that extensions
    (xgrammar's nanobind) see their objects freed."""
    if os.environ.get("KILN_GC_FREEZE", "1") != "1":
        return
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


class EngineCore:
    def __init__(self, engine_dir, *, scheduler_policy: str = "max_utilization",
                 enable_chunked_prefill: bool = True, max_batch_size: int | None = None,
                 max_num_tokens: int | None = None, kv_cache_free_mem_fraction: float | None = None,
                 max_tokens_in_paged_kv_cache: int | None = None, threads: int | None = None,
                 enable_prefix_caching: bool = True, prefix_cache_seed: int | None = None,
                 speculative_config: dict | None = None, max_loras: int = 4, max_cpu_loras: int | None = None,
                 max_model_len: int | None = None):
        threads = configure_threads(threads)
        self.executor = make_executor(engine_dir, kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache, threads,
                                      max_loras)
        build = self.executor.config.build_config
        self.build_config = build
        max_batch_size = _bounded("max_batch_size", max_batch_size, build.max_batch_size)
        self.kv = KVCacheManager(self.executor.num_blocks, build.tokens_per_block, max_batch_size,
                                 build.max_blocks_per_seq, enable_prefix_caching, prefix_cache_seed,
                                 window=self.executor.config.pretrained_config.kv_window,
                                 long_rope_threshold=self.executor.config.pretrained_config.long_rope_threshold)
        self.scheduler = Scheduler(self.kv, max_batch_size, _bounded("max_num_tokens", max_num_tokens,
                                                                     build.max_num_tokens),
                                   build.max_seq_len, scheduler_policy, enable_chunked_prefill,
                                   None if build.lora_config is None else
                                   LoraSlots(self.executor, max_loras, max_cpu_loras or max_loras))
        self.sampler = Sampler()
        self.structured = StructuredOutputManager(engine_dir, self.executor.config.pretrained_config.vocab_size,
                                                  overlap=threads < available_cpus())
        self.spec = SpecDecoder.create(speculative_config, engine_dir, self.executor.config, max_batch_size,
                                       self.executor.num_blocks)
        if self.spec is not None and self.spec.policy.auto:
            self._time_steps()
        self.iteration_stats = IterationStats()
        # Steps in flight at once: one per pipeline stage where the executor can overlap them (not
        # while speculating: drafts need the previous step's tokens).
        self.batch_queue = BatchQueue(1 if self.spec else self.executor.max_concurrent_batches)
        self.requests: dict[str, Request] = {}
        # vLLM's max_model_len: requests are held to it by the frontend; the engine's max_seq_len bounds it
        self.info = EngineInfo(build, self.executor.config.pretrained_config, self.scheduler.max_batch_size,
                               self.scheduler.max_num_tokens, self.executor.num_blocks, build.tokens_per_block,
                               scheduler_policy, enable_chunked_prefill, threads, enable_prefix_caching,
                               _bounded("max_model_len", max_model_len, build.max_seq_len))
        _freeze_heap()

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, r: EngineCoreRequest) -> None:
        # The frontend only reuses an id it has finished (a stop string) that the core still runs.
        self.abort(r.request_id)
        keys = (() if r.cache_salt is None else (r.cache_salt,)) + (
            () if r.lora_request is None else (("lora", r.lora_request.lora_int_id),))
        req = Request(r.request_id, r.prompt_token_ids, r.params, r.max_tokens, r.eos_token_ids, keys,
                      lora_request=r.lora_request, arrival_time=r.arrival_time,
                      forked=r.params.n == 1 and not r.params.use_beam_search)
        req.group = (BeamSearch if r.params.use_beam_search else ParallelSampling if r.params.n > 1
                     else RequestGroup)(req, self)
        req.sequences.append(self.new_sequence(req, 0, list(r.prompt_token_ids)))
        self.requests[r.request_id] = req
        if r.params.guided_decoding is not None:
            self.structured.add(req)  # scheduled once its grammar is compiled
        else:
            self.scheduler.add(req)

    def new_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
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
        self.structured.shutdown()
        self.executor.shutdown()
        gc.unfreeze()

    def stats(self) -> SchedulerStats:
        running = {s.request.request_id for s in self.scheduler.running}
        waiting = {s.request.request_id for s in self.scheduler.waiting} - running
        pool, counters, loras = self.kv.pool, self.scheduler.counters, self.scheduler.loras
        return SchedulerStats(len(running), len(waiting), pool.num_blocks, pool.num_free, pool.usage,
                              counters.num_preemptions, counters.prefix_cache_queries, counters.prefix_cache_hits,
                              self.spec.stats if self.spec else None, self.iteration_stats,
                              *((None,) * 3 if loras is None else loras.counts()))

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """schedule -> plan -> execute -> sample -> emit (several steps in flight under pipeline
        parallelism: _step_with_batch_queue)."""
        errors = self._admit_guided()
        if self.batch_queue.size > 1:
            outputs = self._step_with_batch_queue()
        else:
            step = self._schedule()  # and plan
            if step is None:
                outputs = EngineCoreOutputs([], self.stats())
            else:
                start = time.perf_counter()
                step.masks = self._fill_masks(step)
                outputs = self._process(step, self.executor.execute(step.plan.inputs))  # sample and emit
                if self.spec is not None:
                    drafts = sum(len(rows) - 1 for _, rows in step.plan.verify)
                    self.spec.policy.step_cost.record(len(step.plan.inputs["input_ids"]), time.perf_counter() - start,
                                                      drafts)
        outputs.errors += errors
        return outputs

    def _admit_guided(self) -> list[tuple[list[str], str]]:
        """Guided requests whose grammar is compiled join the scheduler; those whose grammar failed
        end with the reason. With nothing else to do, wait a moment for a compilation."""
        if not self.structured.waiting:
            return []
        if not self.scheduler.running and not self.scheduler.waiting and not self.batch_queue:
            self.structured.wait(0.01)
        ready, failed = self.structured.admit()
        for req in ready:
            self.scheduler.add(req)
        for req, _ in failed:
            self.abort(req.request_id)
        return [([req.request_id], message) for req, message in failed]

    def _fill_masks(self, step: ScheduledStep):
        """The step's grammar bitmasks: filled now, or started on a thread that the engine call overlaps."""
        return self.structured.fill_async([seq for seq, _ in step.plan.sample],
                                          [seq for seq, _ in step.plan.verify])

    def _step_with_batch_queue(self) -> EngineCoreOutputs:
        """Pipeline parallel: a step is submitted while up to pp_size - 1 others are still in the
        stages after the first, so that every stage works on one; each is scheduled from sequences
        not in flight, and the oldest is collected once the pipeline is full or nothing else fits."""
        queue = self.batch_queue
        if len(queue) < queue.size:
            # An even share of the batch per micro-batch: one step holding it all would leave the
            # other stages idle until it is back.
            active = min(len(self.scheduler.running) + len(self.scheduler.waiting), self.scheduler.max_batch_size)
            step = self._schedule(max_seqs=-(-active // queue.size))
            if step is not None:
                queue.push(step)
                self.executor.submit(step.plan.inputs)
                step.masks = self._fill_masks(step)
                if len(queue) < queue.size:
                    return EngineCoreOutputs([], self.stats())
        if not queue:
            return EngineCoreOutputs([], self.stats())
        step = queue.pop()
        return self._process(step, self.executor.collect())

    def _schedule(self, max_seqs: int | None = None) -> ScheduledStep | None:
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        out = self.scheduler.schedule(max_seqs, self.batch_queue.in_flight)
        if not out.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                seq = self.scheduler.waiting[0]
                raise RuntimeError(f"request {seq.request.request_id} cannot be scheduled: the KV cache "
                                   f"({self.kv.pool.num_blocks} blocks) cannot hold it")
            return None
        now = time.monotonic()
        self.iteration_stats.record(out.scheduled, self.scheduler.waiting)
        return ScheduledStep(out, plan_step(out, self.build_config.tokens_per_block, self.kv.block_tables,
                                            bool(self.kv.long_rope_threshold), self.scheduler.loras is not None), now)

    def _process(self, step: ScheduledStep, out) -> EngineCoreOutputs:
        """The step's logits into tokens and outputs. A sequence aborted while its step was in
        flight is skipped: its blocks are already back in the pool. out: the logits, or (an engine
        built for EAGLE-3) the logits and the captured hidden states of every token."""
        logits, captured = out if isinstance(out, tuple) else (out, None)
        if self.spec is not None:
            self.spec.observe(step.out.scheduled, captured)
        touched: dict[str, tuple[Request, EngineCoreOutput]] = {}
        allowed = step.masks.result() if step.masks is not None else {}
        for seq, n in step.out.scheduled:
            if seq.finished:
                continue
            if not seq.draft_token_ids:  # a speculating one's count waits for the verification
                seq.num_computed_tokens += n
                self.kv.cache_full_blocks(seq)
            req = seq.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = step.time
            self._output(touched, req)
        for seq, output, rows in step.plan.prompt_rows:
            if not seq.finished:
                output.take(logits[rows], self._output(touched, seq.request))
        self._sample([(seq, row) for seq, row in step.plan.sample if not seq.finished], logits, touched, allowed)
        if step.plan.verify:
            verified = self.spec.verify(self.sampler, logits, step.plan.verify, allowed)
            for (seq, rows), res in zip(step.plan.verify, verified):
                seq.num_computed_tokens += 1 + res.num_accepted  # K/V of rejected drafts is overwritten later
                self.kv.cache_full_blocks(seq)
                self._emit(seq, res.token_ids, res.logprobs, touched, logits[rows])
        if self.spec is not None:
            self.spec.prune(self.scheduler.running)
        for req, o in touched.values():
            o.finished, o.first_token_time, o.num_cached_tokens = req.finished, req.first_token_time, req.num_cached_tokens
            o.num_draft_tokens, o.num_accepted_tokens = req.num_draft_tokens, req.num_accepted_tokens
        return EngineCoreOutputs([o for _, o in touched.values()], self.stats())

    def _time_steps(self) -> None:
        """Speculation's cost model starts from measured steps: T = 1, 2, 4, ... tokens in one chunk of
        a scratch sequence, logits at every token, as verification takes them (spec_policy.py)."""
        limit = min(self.scheduler.max_num_tokens, self.scheduler.max_batch_size * (1 + self.spec.config.max_draft),
                    PROFILE_MAX_TOKENS)
        tokens = 1
        while tokens <= limit:
            seq = Sequence(Request("profile", [0] * tokens, SamplingParams(), 1), 0, [0] * tokens)
            if not self.kv.allocate_slots(seq, tokens):
                break
            try:
                out = SchedulerOutput()
                out.scheduled.append((seq, tokens))
                plan = plan_step(out, self.build_config.tokens_per_block, self.kv.block_tables,
                                 bool(self.kv.long_rope_threshold))
                plan.inputs["logits_index"] = torch.arange(tokens)
                times = []
                for _ in range(3):  # the first warms the caches
                    start = time.perf_counter()
                    self.executor.execute(plan.inputs)
                    times.append(time.perf_counter() - start)
                self.spec.policy.step_cost.record(tokens, min(times[1:]))
            finally:
                self.kv.free(seq)
            tokens *= 2

    @staticmethod
    def _output(touched: dict, req: Request) -> EngineCoreOutput:
        if req.request_id not in touched:
            touched[req.request_id] = req, EngineCoreOutput(req.request_id, [], None, req.first_scheduled_time,
                                                            None, False)
        return touched[req.request_id][1]

    def _sample(self, to_sample: list[tuple[Sequence, int]], logits: torch.Tensor, touched: dict,
                allowed: dict) -> None:
        """Each scheduled row's sequences, as its request's group draws them, sampled in one call.
        allowed: the bitmask rows of the guided sequences (a forking request's samples share its
        first sequence's: none has emitted a token yet)."""
        seqs, rows, masks, groups = [], [], [], {}
        for seq, row in to_sample:
            group = seq.request.group
            groups[id(group)] = group
            mask = allowed.get(seq, [None])[0]
            for s in group.draw(seq, logits, row):
                seqs.append(s)
                rows.append(row)
                masks.append(mask)
        copies = []
        for group in groups.values():
            settled = group.settle()
            if settled is not None:
                copies += settled.copies
                if settled.results is not None:
                    self._output(touched, group.request).samples += settled.results
                    self._finished(group.request, time.monotonic())
        self.executor.copy_blocks(copies)
        if not seqs:
            return
        # Every row in order (the common decode step): no gather copy of [rows, vocab] logits.
        picked = logits if rows == list(range(logits.shape[0])) else logits[rows]
        result = self.sampler(picked, [SampleRow(s.request.params, s.request.prompt_token_ids, s.output_token_ids,
                                                 s.generator, s.request.eos_token_ids, m) for s, m in zip(seqs, masks)])
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
            self.structured.accept(seq, token)
            if logprobs is not None:
                sample.new_logprobs.append(logprobs[j])
            if sample.new_generation_logits is not None:
                sample.new_generation_logits.append(logits[j].clone())
            self._check_stop(seq, token, sample)
            if sample.finish_reason is not None:
                break
        self._output(touched, req).samples.append(sample)
        if seq.finished and req.finished:
            self._finished(req, now)

    def _finished(self, req: Request, now: float) -> None:
        req.finished_time = now
        self.requests.pop(req.request_id, None)

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
