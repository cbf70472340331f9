"""GEMM tactics chosen by timing at engine build, as TensorRT chooses its tactics (and keeps a timing cache).

For each distinct GEMM of a model (its n, K, weight format and group size) and each token-count
bucket the runtime will see (1, 2, 4, ... up to max_num_tokens: decode, batched decode, prefill
chunks), every kernel of `kiln_cpp::gemm` that runs on the build machine is timed on that shape:
the plugin's float kernels (AVX2, portable), its bf16 ones (AVX-512-BF16, AMX), ATen's matmul on
the unpacked weight (oneDNN/MKL, which use AVX-512-BF16 or AMX where present) and, when the build
allows int8 activations, its integer kernels (AVX2, AVX-512-VNNI). The fastest per bucket goes into
the layer (`PackedLinear.tactics`, a constant of the compiled graph) and into the engine's
build_config (`gemm_tactics`, with the times), and the op runs it by the step's token count.

Every kernel reads the same packed weight, so the choice costs no engine bytes. Kernels need CPU
features; `build_config.cpu_features` lists what the chosen ones need. On a CPU without them the op
runs a kernel that it has, with a warning (csrc/gemm.cpp), never an illegal instruction.
"""
from __future__ import annotations

import itertools
import json
import os
import platform
import time
from pathlib import Path

import torch

from kiln.plugins import cpp

PORTABLE, AMX_BF16, ATEN, PORTABLE_INT8 = 1, 4, 5, 8
# Token counts above this are timed at it: every kernel's cost per token is flat past it (they
# tile rows), and a prefill-sized GEMM of each candidate would make builds long.
MAX_TIMED_TOKENS = 1024
# A kernel more than this many times slower than the best at two buckets in a row is not timed at
# larger ones (it only gets slower relative to the tiled kernels as the token count grows). Never
# AMX's: its call is mostly decoding the panels into tiles, the same for 1 token as for 16, so it
# loses the first buckets of an int8 or int4 GEMM by 7x and wins the prefill-sized ones by 3x.
PRUNE_RATIO = 4.0
NEVER_PRUNED = (AMX_BF16,)


def buckets(max_num_tokens: int) -> list[int]:
    """Upper bounds of the token-count buckets: powers of two up to MAX_TIMED_TOKENS, then max_num_tokens."""
    out, m = [], 1
    while m < min(max_num_tokens, MAX_TIMED_TOKENS + 1):
        out.append(m)
        m *= 2
    return out + [max_num_tokens]


def kernel_name(kernel: int) -> str:
    cpp.load()
    return torch.ops.kiln_cpp.gemm_kernel_name(kernel)


def kernel_ids() -> dict[str, int]:
    cpp.load()
    out, i = {}, 0
    while True:
        try:
            out[torch.ops.kiln_cpp.gemm_kernel_name(i)] = i
        except RuntimeError:
            return out
        i += 1


def features_needed(kernels) -> list[str]:
    """The CPU features the kernels need (names as cpu_features())."""
    cpp.load()
    mask = 0
    for k in kernels:
        mask |= torch.ops.kiln_cpp.gemm_kernel_info(k)[0]
    names = ["avx2", "avx512", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"]
    return [n for i, n in enumerate(names) if mask >> i & 1]


def cpu_features() -> list[str]:
    cpp.load()
    return [f for f in torch.ops.kiln_cpp.cpu_features().split(",") if f]


def missing_features(build_config: dict) -> list[str]:
    """Features an engine's tactics need that this CPU lacks (the op then falls back, with a warning)."""
    have = set(cpu_features())
    return [f for f in build_config.get("cpu_features") or [] if f not in have]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def candidates(weight: torch.Tensor, x_dtype: torch.dtype, int8_activations: bool) -> list[int]:
    cpp.load()
    ids = list(torch.ops.kiln_cpp.gemm_kernels(weight, x_dtype))
    if not int8_activations:
        ids = [k for k in ids if not torch.ops.kiln_cpp.gemm_kernel_info(k)[1]]
    # The portable kernels are the fallback of CPUs without AVX2; a vector kernel always beats them.
    vector = [k for k in ids if k not in (PORTABLE, PORTABLE_INT8, ATEN)]
    return [k for k in ids if k not in (PORTABLE, PORTABLE_INT8)] if vector else ids


# Part of every cached measurement's key: a new method of timing never reuses the old one's figures.
TIMING_METHOD = "cycled"  # each call reads another layer's (or expert's) weights (_time_us)


class TimingCache:
    """Measured microseconds per (machine, library, threads, GEMM, tokens, kernel), kept in a JSON
    file between builds (`engine-build --timing_cache FILE`). A changed kernel source, CPU, thread
    count or timing method gives new keys, so a stale measurement is never reused."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path else None
        self.entries: dict[str, float] = {}
        self.hits = self.misses = 0
        self.load = None  # how busy the machine was while select() timed through this cache
        if self.path and self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
                self.entries = {k: float(v) for k, v in data.get("entries", {}).items()}
            except (ValueError, AttributeError, TypeError) as e:
                from kiln.config import ConfigError

                raise ConfigError(f"timing cache {self.path} is not a kiln timing cache ({e}); "
                                  f"delete it or pass another file") from None
        self.prefix = (f"{cpu_model()}|{','.join(cpu_features())}|{cpp._key()}|{torch.get_num_threads()}t"
                       f"|{TIMING_METHOD}")

    def _full(self, key: str, kernel: int) -> str:
        return f"{self.prefix}|{key}|{kernel_name(kernel)}"

    def put(self, key: str, times: dict[int, float]) -> None:
        self.entries.update({self._full(key, k): us for k, us in times.items()})

    def get(self, key: str, kernels: list[int], measure) -> dict[int, float]:
        """Microseconds per kernel at `key`: from the cache, measure(missing kernels) for the rest."""
        full = {k: self._full(key, k) for k in kernels}
        missing = [k for k in kernels if full[k] not in self.entries]
        self.hits += len(kernels) - len(missing)
        self.misses += len(missing)
        if missing:
            for k, us in measure(missing).items():
                self.entries[full[k]] = us
        return {k: self.entries[full[k]] for k in kernels}

    def save(self) -> None:
        if not self.path:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"version": 1, "entries": self.entries}, indent=0, sort_keys=True) + "\n")
        os.replace(tmp, self.path)


# A bucket whose winner's median call is this many times its fastest was timed through noise (a
# descheduled thread, another process's bursts): it is timed again.
NOISY_SPREAD = 1.5
# Other processes taking more than this many CPUs on average while the tactics were timed make the
# build warn that its choices may be noise.
LOADED_CPUS = 0.5


class MachineLoad:
    """The CPU time other processes (and other VMs: steal) took while this one timed its tactics,
    from /proc/stat's busy time less this process's own, per second of wall time."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            busy = (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")  # user nice system irq softirq steal
        except (OSError, ValueError):
            busy = None
        own = os.times()
        return time.monotonic(), busy, own.user + own.system

    def other_cpus(self) -> float | None:
        (t0, busy0, own0), (t1, busy1, own1) = self.start, self._sample()
        if busy0 is None or busy1 is None or t1 - t0 <= 0:
            return None
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / (t1 - t0))


def operands(layers) -> list[tuple]:
    """(weight, scale) of each GEMM the layers run: one per layer, one per expert of a mixture's
    stacked experts."""
    out = []
    for layer in layers:
        if layer.weight.dim() == 4:
            out += [(w, None if layer.scale is None else layer.scale[e]) for e, w in enumerate(layer.weight)]
        else:
            out.append((layer.weight, layer.scale))
    return out


def _time_us(layer, m: int, kernels: list[int], x_dtype: torch.dtype, budget_s: float = 0.05,
             spread: dict | None = None, weights: list[tuple] | None = None) -> dict[int, float]:
    """Microseconds per call of layer's GEMM at m tokens on each kernel: the fastest single call of
    rounds that take the plugin's kernels in turn (ATen's in rounds of its own). A shared machine's
    noise (a descheduled thread, another process's cache traffic) only ever slows a call down, and
    taking turns keeps a slow minute from landing on one kernel. spread, if given, gets each kernel's median call over its fastest.

    The calls are the ones the model makes:
    - Each takes the next of `weights` (default: operands([layer])), the (weight, scale) of every
      layer of this shape or expert: a decode step reads each once, from memory, where one weight
      timed over and over is read from the cache.
    - A mixture's experts run on one thread each when the moe op does so (csrc/moe.cpp: at least
      two chosen experts per thread), and fc with its activation fused.
    """
    from kiln.plugins import gemm

    threads = torch.get_num_threads()
    if threads > 1 and getattr(layer, "experts_per_token", 0) >= 2 * threads:
        torch.set_num_threads(1)
        try:
            return _time_us(layer, m, kernels, x_dtype, budget_s, spread, weights)
        finally:
            torch.set_num_threads(threads)
    x = torch.randn(m, layer.k, generator=torch.Generator().manual_seed(m)).to(x_dtype)
    turn = itertools.cycle(weights or operands([layer]))

    def call(kernel):
        weight, scale = next(turn)
        start = time.perf_counter()
        if getattr(layer, "swiglu", False):  # the call the layer makes: its activation fused or not
            gemm.gemm_swiglu(x, weight, scale, layer.bias, layer.n, layer.group_size, (1 << 62, kernel))
        else:
            gemm.gemm(x, weight, scale, layer.bias, layer.n, layer.group_size, layer.out_float, (1 << 62, kernel))
        return time.perf_counter() - start

    calls = {k: [] for k in kernels}
    # ATen's OpenMP threads spin for a while after each call, taking the cores from the plugin's
    # pool: a plugin kernel timed right after ATen measured up to 5x slower (avx2_int8 at one
    # token: 209 us against 47 us), enough to lose a bucket it wins. So ATen takes its own turns.
    own = [k for k in kernels if k != ATEN]
    for group in [g for g in (own, [k for k in kernels if k == ATEN]) if g]:
        for k in group:
            call(k)  # warms it up
        start, rounds = time.perf_counter(), 0
        while rounds < 3 or (rounds < 50 and time.perf_counter() - start < budget_s):
            for k in group:
                calls[k].append(call(k))
            rounds += 1
    if spread is not None:
        spread.update({k: sorted(c)[len(c) // 2] / max(min(c), 1e-12) for k, c in calls.items()})
    return {k: min(c) * 1e6 for k, c in calls.items()}


def gemm_key(layer, x_dtype: torch.dtype) -> str:
    w, top = layer.weight, getattr(layer, "experts_per_token", 0)
    return (f"n{layer.n}_k{layer.k}_{str(w.dtype).removeprefix('torch.')}"
            f"{'_g' + str(layer.group_size) if layer.group_size else ''}"
            f"{'_f32out' if layer.out_float else ''}{'_swiglu' if getattr(layer, 'swiglu', False) else ''}"
            f"{f'_experts{top}' if top else ''}"
            f"_x{str(x_dtype).removeprefix('torch.')}")


def select(layers: dict[str, object], x_dtype: torch.dtype, max_num_tokens: int, int8_activations: bool,
           cache: TimingCache, log=print) -> dict:
    """Times the candidates of each distinct GEMM in `layers` (name -> PackedLinear) per bucket,
    sets each layer's tactics, and returns build_config's gemm_tactics table."""
    by_key: dict[str, list] = {}
    for name, layer in layers.items():
        by_key.setdefault(gemm_key(layer, x_dtype), []).append((name, layer))
    table = {}
    bounds = buckets(max_num_tokens)
    load, retimed = MachineLoad(), 0
    for key, members in by_key.items():
        layer, weights = members[0][1], operands([member for _, member in members])
        alive = candidates(layer.weight, x_dtype, int8_activations)
        if getattr(layer, "experts_per_token", 0):
            # The moe op plans experts on its pool's threads: ATen's matmul there would start an OpenMP
            # team per pool thread, and libgomp, counting more threads than cores, then stops spinning
            # in every team of the process (llama.cpp in the same process: 480 -> 190 tok/s).
            alive = [k for k in alive if k != ATEN]
        rows, pairs, behind = [], [], set()
        for bound in bounds:
            m = min(bound, MAX_TIMED_TOKENS)
            spread = {}
            times = cache.get(f"{key}|m{m}", alive,
                              lambda kernels: _time_us(layer, m, kernels, x_dtype, spread=spread, weights=weights))
            best = min(times, key=times.get)
            if spread.get(best, 1.0) > NOISY_SPREAD:  # once more, longer; the fastest of both kept
                retimed += 1
                again = _time_us(layer, m, alive, x_dtype, budget_s=0.15, weights=weights)
                times = {k: min(times[k], again[k]) for k in alive}
                cache.put(f"{key}|m{m}", times)
                best = min(times, key=times.get)
            slow = {kern for kern in alive if times[kern] > PRUNE_RATIO * times[best] and kern not in NEVER_PRUNED}
            alive, behind = [kern for kern in alive if kern not in slow & behind], slow
            rows.append({"m_max": bound, "timed_at": m, "kernel": kernel_name(best),
                         "us": {kernel_name(k): round(t, 1) for k, t in times.items()}})
            pairs += [bound, best]
        # adjacent buckets with one winner become one
        merged = []
        for i in range(0, len(pairs), 2):
            if merged and merged[-1] == pairs[i + 1]:
                merged[-2] = pairs[i]
            else:
                merged += pairs[i:i + 2]
        for _, member in members:
            member.tactics = tuple(merged)
        table[key] = {"layers": len(members), "buckets": rows}
    other = load.other_cpus()
    cache.load = {"other_cpus": None if other is None else round(other, 2),
                   "load_average": round(os.getloadavg()[0], 2), "buckets": len(table) * len(bounds),
                  "retimed": retimed}
    return table


def format_table(table: dict) -> str:
    """The tactic table engine-build prints: per GEMM, the winner and its time per bucket."""
    lines = []
    for key, entry in table.items():
        lines.append(f"{key} ({entry['layers']} layer{'s' if entry['layers'] > 1 else ''}):")
        for row in entry["buckets"]:
            others = ", ".join(f"{k} {v:g}" for k, v in sorted(row["us"].items(), key=lambda kv: kv[1])
                               if k != row["kernel"])
            at = f" (timed at {row['timed_at']})" if row["timed_at"] != row["m_max"] else ""
            lines.append(f"  M <= {row['m_max']:>5}: {row['kernel']:<12} {row['us'][row['kernel']]:>10.1f} us{at}"
                         + (f"   ({others})" if others else ""))
    return "\n".join(lines)


def format_choices(table: dict) -> str:
    """One line per GEMM: the kernel chosen for each range of token counts (engine-build's default)."""
    lines = []
    for key, entry in table.items():
        spans, low = [], 1
        for row in entry["buckets"]:
            if spans and spans[-1][2] == row["kernel"]:
                spans[-1][1] = row["m_max"]
            else:
                spans.append([low, row["m_max"], row["kernel"]])
            low = row["m_max"] + 1
        chosen = ", ".join(f"{k} for M {a}-{b}" if a != b else f"{k} for M {a}" for a, b, k in spans)
        lines.append(f"  {key} ({entry['layers']} layer{'s' if entry['layers'] > 1 else ''}): {chosen}")
    return "\n".join(lines)


def kernels_of(table: dict) -> set[int]:
    ids = kernel_ids()
    return {ids[row["kernel"]] for entry in table.values() for row in entry["buckets"]}
