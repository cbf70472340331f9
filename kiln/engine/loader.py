"""Loads one rank engine of an engine dir and runs engine steps against its KV cache pool."""
import os
from pathlib import Path

import psutil
import torch
import torch.utils._pytree as pytree

from kiln.config import ConfigError, EngineConfig, torch_dtype
from kiln.engine import extraction, huge_pages
from kiln.engine.format import (HIDDEN_STATES, LORA_POOLS, LORA_RANKS, LORA_SLOTS, SEQUENCE_LENS, STEP_INPUTS,
                               engine_file, kv_cache_dtype, lora_pool_shapes, op_libraries, plugin_config)


class AOTIModel:
    """Runs a loaded AOTInductor package on keyword arguments, as torch's AOTICompiledModel does, but
    without importing torch.export's serializer and with it dynamo: 1.4 s of CPU that a process
    loading only an engine need not spend."""

    def __init__(self, loader, serial_loops: bool = False):
        self.loader = loader
        in_spec, self.out_spec = (pytree.treespec_loads(spec) for spec in loader.get_call_spec())
        self.in_spec = in_spec.child(1)  # the order the package takes its keyword arguments in
        self.serial_loops = serial_loops

    def __call__(self, **inputs):
        args = _leaves(inputs, self.in_spec)
        if not self.serial_loops:
            return pytree.tree_unflatten(self.loader.boxed_run(args), self.out_spec)
        # The graph's own loops (norms, rope, activations: OpenMP regions, each ending in a barrier
        # of all threads) run on this thread; the kiln_cpp kernels run on their pool.
        previous = torch.ops.kiln_cpp.serial_loops_begin()
        try:
            return pytree.tree_unflatten(self.loader.boxed_run(args), self.out_spec)
        finally:
            torch.ops.kiln_cpp.serial_loops_end(previous)


def _leaves(value, spec) -> list:
    """The tensors of `value` in the order of `spec` (dicts by its keys: the lora_pools dict too)."""
    if spec.type is dict:
        return [leaf for i, key in enumerate(spec.context) for leaf in _leaves(value[key], spec.child(i))]
    return [value]


def serial_graph_loops(engine_dir: Path) -> bool:
    """Whether an aoti engine's compiled loops run on the calling thread alone: where the GEMMs and
    attention are kiln_cpp's (they run on the kernels' pool), unless $KILN_GRAPH_LOOPS=parallel."""
    mode = os.environ.get("KILN_GRAPH_LOOPS", "serial")
    if mode not in ("serial", "parallel"):
        raise ValueError(f"KILN_GRAPH_LOOPS must be 'serial' or 'parallel', got {mode!r}")
    plugins = plugin_config(engine_dir)
    return mode == "serial" and plugins.get("gemm_plugin") == "cpp" and plugins.get("gpt_attention_plugin") == "cpp"


def use_caching_allocator() -> None:
    """CPU tensors from kiln_cpp's caching allocator (kiln/plugins/csrc/cpu_allocator.cpp): a step's
    few hundred buffers come from its free lists instead of glibc's arena, unless
    $KILN_CPU_ALLOCATOR=system."""
    choice = os.environ.get("KILN_CPU_ALLOCATOR", "caching")
    if choice not in ("caching", "system"):
        raise ValueError(f"KILN_CPU_ALLOCATOR must be 'caching' or 'system', got {choice!r}")
    torch.ops.kiln_cpp.use_caching_allocator(choice == "caching", huge_pages.enabled())


def register_ops(config: EngineConfig) -> tuple[str, ...]:
    """Registers the op libraries the engine calls (kiln.engine.format.op_libraries), before its graph
    is deserialized: whichever entry point loads it, in whatever fresh process. Returns them."""
    import kiln.plugins  # noqa: F401  (the kiln:: Python ops)

    libraries = op_libraries(config.pretrained_config, config.build_config)
    if "kiln_cpp" in libraries:
        from kiln.plugins import cpp

        cpp.ensure_built()  # registers the kiln_cpp:: ops (building them once if this machine has not)
        use_caching_allocator()
    if "kiln_gpu" in libraries:
        from kiln.plugins import gpu

        gpu.check_runnable(config.build_config.target_device)
        gpu.load()
    return libraries


def load(backend: str, path: Path, unpacked: Path | None = None):
    """A callable taking the step inputs as keyword arguments and returning logits.

    unpacked: for aoti, a folder holding the files of the package at path
    (kiln/engine/extraction.py), which AOTInductor's loader runs from without writing anything;
    without it the loader unpacks the package into $TMPDIR itself."""
    config = EngineConfig.load(Path(path).parent)
    libraries = register_ops(config)
    if backend == "aoti":
        # The loader itself: aoti_load_package cannot take a folder, and given a file object (a
        # path would have to end in .pt2) it first copies the whole package to a temporary file.
        serial = serial_graph_loops(Path(path).parent)
        if "kiln_cpp" in libraries:
            from kiln.plugins import c_shims

            c_shims.check(config.build_config.c_shims, str(path))
        with huge_pages.loading(unpacked or path):
            package = torch._C._aoti.AOTIModelPackageLoader(str(unpacked or path), "model", False, 1, -1)
        return AOTIModel(package, serial)
    if backend == "eager":
        with open(path, "rb") as f:
            return torch.export.load(f).module()
    raise ValueError(f"unknown backend {backend!r}")


def check_device(build, engine_dir: Path) -> None:
    """A one-line error unless this machine has the device the engine was built for: its GPU's
    architecture (build_config.gpu_arch, "sm_90"), for a CUDA engine."""
    if build.target_device == "cpu":
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"{engine_dir} was built for a CUDA GPU and this machine has none (torch.cuda.is_available() "
                          f"is False): serve it on a GPU machine, or rebuild it with engine-build --device cpu")
    major, minor = torch.cuda.get_device_capability()
    if build.gpu_arch and build.gpu_arch != f"sm_{major}{minor}":
        raise ConfigError(f"{engine_dir} was built for {build.gpu_arch} and this GPU ({torch.cuda.get_device_name()}) is "
                          f"sm_{major}{minor}: rebuild the engine with engine-build on this GPU")


class RankEngine:
    """rank: which rank engine (rank{N}.engine) to load. ranks_per_machine: ranks whose KV pools
    share this machine's memory. allocate=False leaves the pool to allocate(), once the ranks have
    agreed on one size (each holds its own shard of the same blocks)."""

    def __init__(self, engine_dir, kv_cache_free_mem_fraction: float | None = None,
                 max_tokens_in_paged_kv_cache: int | None = None, *, rank: int = 0,
                 ranks_per_machine: int = 1, allocate: bool = True, max_loras: int = 4):
        self.engine_dir = Path(engine_dir)
        self.config = EngineConfig.load(self.engine_dir)
        pretrained, build = self.config.pretrained_config, self.config.build_config
        if not 0 <= rank < pretrained.mapping.world_size:
            raise ConfigError(f"{engine_dir}: rank {rank} is outside the engine's world_size "
                              f"{pretrained.mapping.world_size}")
        check_device(build, self.engine_dir)
        self.rank = rank
        self.num_layers = len(pretrained.layers_of(pretrained.mapping.pp_rank(rank)))
        path = engine_file(self.engine_dir, rank)
        if not path.is_file():
            raise ConfigError(f"{path} not found: the engine dir is incomplete; rebuild it with `engine-build`")
        try:
            # aoti: unpacked once, into a folder of this process's own (extraction.py)
            self.model = (extraction.load_unpacked(path, lambda folder: load("aoti", path, unpacked=folder))
                          if build.backend == "aoti" else load(build.backend, path))
        except (ImportError, extraction.UnpackError, ConfigError):  # an install, a disk, a machine: not the file
            raise
        except Exception as e:  # a truncated/corrupt file surfaces as zipfile/torch errors
            reason = (str(e).strip().splitlines() or [""])[0]
            raise ConfigError(f"{path} is not a loadable {build.backend} engine ({type(e).__name__}: "
                              f"{reason}); rebuild it with `engine-build`") from None
        self.num_blocks = self._num_blocks(kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache,
                                           ranks_per_machine)
        self.kv_cache = None
        if allocate:
            self.allocate(self.num_blocks)
        # LoRA engines: max_loras adapter slots per target module, filled by set_lora
        self.lora_pools = self.lora_ranks = None
        if build.lora_config is not None:
            if max_loras < 1:
                raise ConfigError(f"max_loras must be >= 1 for a LoRA engine, got {max_loras}")
            self.lora_pools = {m: torch.zeros(shape, dtype=torch_dtype(pretrained.dtype))
                               for m, shape in lora_pool_shapes(pretrained, build, rank, max_loras).items()}
            self.lora_ranks = torch.zeros(max_loras, dtype=torch.int64)

    def allocate(self, num_blocks: int) -> None:
        p, b = self.config.pretrained_config, self.config.build_config
        self.num_blocks = num_blocks
        self.kv_cache = torch.zeros(self.num_layers, 2, num_blocks, b.tokens_per_block, p.kv_heads_per_rank,
                                    p.head_size, dtype=kv_cache_dtype(p, b))

    @property
    def bytes_per_block(self) -> int:
        p, b = self.config.pretrained_config, self.config.build_config
        dtype = kv_cache_dtype(p, b)
        return self.num_layers * 2 * b.tokens_per_block * p.kv_heads_per_rank * p.head_size * dtype.itemsize

    def _num_blocks(self, fraction, max_tokens, ranks_per_machine: int = 1) -> int:
        b = self.config.build_config
        if fraction is not None and not 0 < fraction <= 1:
            raise ConfigError(f"kv_cache_free_mem_fraction must be in (0, 1], got {fraction}")
        if max_tokens is not None:
            if max_tokens < b.tokens_per_block:
                raise ConfigError(f"max_tokens_in_paged_kv_cache must be >= tokens_per_block "
                                  f"({b.tokens_per_block}), got {max_tokens}")
            return max(2, max_tokens // b.tokens_per_block)
        # Enough for every slot of the batch at full length, unless memory says less.
        enough = b.max_batch_size * b.max_blocks_per_seq + 1
        budget = int(psutil.virtual_memory().available * (fraction or 0.5)) // (self.bytes_per_block * ranks_per_machine)
        if fraction is not None:
            return max(2, budget)
        return max(2, min(enough, budget))

    def __call__(self, inputs: dict, hidden_states: torch.Tensor | None = None):
        """Logits; or, on a pipeline stage before the last, the hidden states for the next one; or, for
        an EAGLE-3 target, (logits, [T, layers * hidden] captured hidden states)."""
        extra = {} if hidden_states is None else {HIDDEN_STATES: hidden_states}
        if self.config.pretrained_config.long_rope_threshold:
            extra[SEQUENCE_LENS] = inputs[SEQUENCE_LENS]
        if self.lora_pools is not None:
            slots = inputs.get(LORA_SLOTS)
            extra[LORA_SLOTS] = torch.full_like(inputs["input_ids"], -1) if slots is None else slots
            extra[LORA_RANKS], extra[LORA_POOLS] = self.lora_ranks, self.lora_pools
        out = self.model(**{name: inputs[name] for name in STEP_INPUTS[:-1]}, kv_cache=self.kv_cache, **extra)
        if isinstance(out, tuple):  # an EAGLE-3 target: the captured layers' outputs, side by side in layer order
            logits, captured = out
            return logits, torch.cat([captured[f"layers.{i}"] for i in self.config.build_config.hidden_state_layers], -1)
        return out

    def set_lora(self, slot: int, weights: dict | None) -> None:
        """Adapter slot `slot` holds `weights` (module -> [(A [r, in], B [out, r] scaled) or None per layer
        of the stage], this rank's share: kiln.lora.shard.rank_weights), or nothing (None)."""
        self.lora_ranks[slot] = max((pair[0].shape[0] for pairs in (weights or {}).values() for pair in pairs
                                     if pair is not None), default=0)
        for m, pool in self.lora_pools.items():
            pool[:, slot].zero_()
            for layer, pair in enumerate((weights or {}).get(m, ())):
                if pair is None:
                    continue
                a, b = pair
                r, k = a.shape
                pool[layer, slot, :r, :k] = a
                pool[layer, slot, :r, k:] = b.t()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = zip(*pairs)
            self.kv_cache[:, :, list(dst)] = self.kv_cache[:, :, list(src)]
