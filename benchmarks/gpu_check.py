"""The prepared device check of the GPU op set (issue 64): one run on an H100/H200, one table.

  python benchmarks/gpu_check.py            # on a GPU machine: every section, under 8 minutes
  TRITON_INTERPRET=1 python benchmarks/gpu_check.py --device cpu --quick   # this script's own smoke run

Sections (each row: what, result, figure):
1. kernels: the kernel tests (tests/test_gpu_kernels.py and its siblings, written for CPU tensors)
   with every kiln_gpu op run on the GPU: its tensor arguments copied there, its results (and what
   it mutates) copied back.
2. parity: tiny Llama-3.2, Qwen2.5, Gemma 2 and Mixtral (tests/published_models.py, random weights)
   on the Triton op set against HF transformers: float32 greedy tokens, bfloat16 top-1 agreement
   along HF's greedy paths.
3. speed: a Llama-3.2-1B-shaped bfloat16 model (random weights) on the Triton op set, driven step by
   step here (Kiln builds no CUDA engine yet; this runs the model's forward in PyTorch with the
   engine's step inputs): decode tokens/s at batch 1 and 64 (steps replayed from CUDA graphs),
   prefill tokens/s of 2,048-token prompts, batch-1 decode as a fraction of the HBM roofline (bytes
   per step / the measured device copy bandwidth), and HF `generate` on the same weights.

Needs torch, triton, transformers, safetensors and pytest (carry wheels where the machine has none:
`pip download --no-deps transformers tokenizers safetensors huggingface-hub pytest pluggy iniconfig
-d wheels`, then `pip install --no-index wheels/*`).
"""
import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

ROWS: list[tuple[str, str, str]] = []


def row(what: str, result: str, figure: str = "") -> None:
    ROWS.append((what, result, figure))
    print(f"{what:<58} {result:<8} {figure}", flush=True)


# -- 1. kernels ---------------------------------------------------------------------------------

class OnDevice:
    """A pytest plugin: every kiln_gpu op the tests call runs on `device`."""

    def __init__(self, device: str):
        self.device = device

    def pytest_configure(self, config):
        import importlib

        from kiln.plugins import gpu

        gpu.load()
        for name in [f"kiln.plugins.gpu.{m}" for m in gpu.MODULES] + ["kiln.models.gpu_linear", "kiln.models.gpu_moe"]:
            module = importlib.import_module(name)
            for attr, value in list(vars(module).items()):
                if type(value).__name__ == "CustomOpDef":
                    setattr(module, attr, self.wrap(value))

    def wrap(self, op):
        device = self.device

        def call(*args, **kwargs):
            moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
            kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            out = op(*moved, **kw)
            for a, m in zip(args, moved):  # in-place ops (the KV write, LoRA's expand) mutate an argument
                if isinstance(a, torch.Tensor) and m is not a:
                    a.copy_(m)
            return tuple(o.cpu() for o in out) if isinstance(out, tuple) else (
                out.cpu() if isinstance(out, torch.Tensor) else out)

        return call


def check_kernels(device: str) -> None:
    import pytest

    class Counts:
        def __init__(self):
            self.by_file = {}

        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.outcome != "passed":
                counts = self.by_file.setdefault(report.nodeid.split("::")[0], {"passed": 0, "failed": 0, "skipped": 0})
                counts[report.outcome] += 1

    counts = Counts()
    files = sorted(str(p) for p in (ROOT / "tests").glob("test_gpu_*.py") if p.name != "test_gpu_engine.py")
    # (not the export tests: the wrapper's copies would be in their graphs)
    pytest.main(["-q", "-p", "no:cacheprovider", "-k", "not export", *files], plugins=[OnDevice(device), counts])
    for name, c in sorted(counts.by_file.items()):
        row(f"kernels {Path(name).name}", "ok" if not c["failed"] else "FAIL",
            f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")


# -- the model, driven step by step ---------------------------------------------------------------

class Driver:
    """Greedy steps of a LlamaForCausalLM on its device: prompts prefilled in one step, then one decode
    step per token for the whole batch, each sequence on its own contiguous pages."""

    def __init__(self, model, config, batch: int, max_len: int, block_size: int = 32):
        self.model, self.block_size, self.device = model, block_size, next(model.parameters()).device
        self.blocks = -(-max_len // block_size)
        kv_dtype = next(model.parameters()).dtype
        self.kv = torch.zeros(len(model.layer_ids), 2, batch * self.blocks + 1, block_size, config.kv_heads_per_rank,
                              config.head_size, dtype=kv_dtype, device=self.device)
        self.tables = torch.arange(batch * self.blocks, dtype=torch.int32, device=self.device).view(batch, self.blocks)

    def _slots(self, seq: int, positions: torch.Tensor) -> torch.Tensor:
        return self.tables[seq, positions // self.block_size].long() * self.block_size + positions % self.block_size

    def prefill(self, prompts: list[list[int]], all_logits: bool = False) -> torch.Tensor:
        d, i32, i64 = self.device, torch.int32, torch.int64
        lens = [len(p) for p in prompts]
        index = torch.full((len(prompts), max(lens)), -1, dtype=i64, device=d)
        start = 0
        for s, n in enumerate(lens):
            index[s, :n] = torch.arange(start, start + n, device=d)
            start += n
        positions = torch.cat([torch.arange(n, device=d) for n in lens])
        slots = torch.cat([self._slots(s, torch.arange(n, device=d)) for s, n in enumerate(lens)])
        ends = torch.tensor(lens, device=d).cumsum(0) - 1
        logits = self.model(torch.tensor([t for p in prompts for t in p], dtype=i64, device=d), positions, slots, index,
                            self.tables[:len(prompts)], torch.tensor(lens, dtype=i32, device=d),
                            torch.empty(0, dtype=i64, device=d), torch.empty(0, 1, dtype=i32, device=d),
                            torch.empty(0, dtype=i32, device=d),
                            torch.arange(start, device=d) if all_logits else ends, self.kv)
        return logits

    def decode_inputs(self, tokens: torch.Tensor, lens: torch.Tensor) -> tuple:
        """One decode step's inputs: tokens [B] at positions lens [B] (the lengths before them)."""
        d, B = self.device, tokens.shape[0]
        slots = self.tables[torch.arange(B, device=d), lens // self.block_size].long() * self.block_size + (
            lens % self.block_size)
        return (tokens, lens.long(), slots, torch.empty(0, 1, dtype=torch.int64, device=d),
                torch.empty(0, 1, dtype=torch.int32, device=d), torch.empty(0, dtype=torch.int32, device=d),
                torch.arange(B, device=d), self.tables[:B], (lens + 1).int(), torch.arange(B, device=d), self.kv)

    def greedy(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        with torch.no_grad():
            tokens = self.prefill(prompts).argmax(-1)
            out, lens = [tokens], torch.tensor([len(p) for p in prompts], device=self.device)
            for _ in range(new_tokens - 1):
                tokens = self.model(*self.decode_inputs(tokens, lens)).argmax(-1)
                lens = lens + 1
                out.append(tokens)
        return torch.stack(out, 1).tolist()


def triton_model(model_dir: Path, dtype: str, device: str):
    from kiln.build.weights import load_rank_weights
    from kiln.config import PretrainedConfig
    from kiln.convert.cli import convert_checkpoint
    from kiln.models.llama import LlamaForCausalLM
    from kiln.models.ops.op_set import GROUPS, OpSet

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = convert_checkpoint(model_dir, Path(tmp) / "c", dtype=dtype)
        config = PretrainedConfig.load(ckpt)
        weights = load_rank_weights(ckpt, config, 0)
    model = LlamaForCausalLM(config, weights, 0, OpSet(dict.fromkeys(GROUPS, "triton"))).eval().to(device)
    return model, config


# -- 2. parity -----------------------------------------------------------------------------------

def check_parity(device: str, names: list[str]) -> None:
    from published_models import NEW_TOKENS, read_oracle, write_oracle

    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            write_oracle(name, Path(tmp))  # HF float32 on CPU: the oracle
            oracle = read_oracle(Path(tmp), name)
            prompts = oracle["prompts"]
            model, config = triton_model(oracle["model_dir"], "float32", device)
            tokens = Driver(model, config, len(prompts), 256).greedy(prompts, NEW_TOKENS)
            same = sum(t == o for t, o in zip(tokens, oracle["tokens"]))
            row(f"parity {name} float32 greedy vs HF", "ok" if same == len(prompts) else "FAIL",
                f"{same}/{len(prompts)} prompts x {NEW_TOKENS} tokens identical")
            model, config = triton_model(oracle["model_dir"], "bfloat16", device)
            paths = [p + t for p, t in zip(prompts, oracle["tokens"])]
            with torch.no_grad():
                logits = Driver(model, config, len(paths), 256).prefill(paths, all_logits=True).float().cpu()
            agree = hf_agree = total = start = 0
            hf16 = hf_bf16(oracle["model_dir"], device)
            for p, path, want in zip(prompts, paths, oracle["logits"]):
                want = want.argmax(-1)
                ours = logits[start + len(p) - 1: start + len(p) - 1 + NEW_TOKENS].argmax(-1)
                with torch.no_grad():
                    theirs = hf16(torch.tensor([path], device=device)).logits[0, len(p) - 1:-1].float().cpu().argmax(-1)
                agree, hf_agree = agree + int((ours == want).sum()), hf_agree + int((theirs == want).sum())
                total, start = total + NEW_TOKENS, start + len(path)
            # Random tiny models have near-ties that bfloat16 flips: HF's own bfloat16 is the yardstick
            row(f"parity {name} bfloat16 top-1 vs HF float32", "ok" if agree >= min(0.99 * total, hf_agree) else "FAIL",
                f"{100 * agree / total:.1f}% of {total} (HF bfloat16: {100 * hf_agree / total:.1f}%; target >= 99%)")


def hf_bf16(model_dir: Path, device: str):
    import transformers

    eager = {"attn_implementation": "eager"} if model_dir.name == "gemma2" else {}  # its soft cap
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, **eager).to(device).eval()


# -- 3. speed -------------------------------------------------------------------------------------

LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                    rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
                    rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                  "original_max_position_embeddings": 8192, "rope_type": "llama3"})


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> float:
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy, read and write both counted."""
    n = (1 << 30) if device == "cuda" else (1 << 26)
    src, dst = torch.ones(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    return max(2 * n / timed(lambda: dst.copy_(src), device, 10) for _ in range(3))


def decode_step(driver: Driver, batch: int, context: int, device: str, graphs: bool):
    """A callable replaying one decode step of `batch` sequences at `context` tokens (from a CUDA graph
    where it captures), and whether it is a graph."""
    tokens = torch.randint(0, 1000, (batch,), device=device)
    inputs = driver.decode_inputs(tokens, torch.full((batch,), context, device=device))
    step = lambda: driver.model(*inputs)  # noqa: E731
    if not graphs:
        return step, False
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph.replay, True
    except Exception as e:  # say why, and time the eager step instead
        row(f"speed: CUDA graph capture at batch {batch}", "FAIL", f"{type(e).__name__}: {str(e)[:80]}")
        return step, False


def check_speed(device: str, quick: bool) -> None:
    import transformers

    shape = dict(LLAMA_3_2_1B, num_hidden_layers=2, vocab_size=4096, hidden_size=256, intermediate_size=512,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=32) if quick else LLAMA_3_2_1B
    prompt, context, batches = (64, 64, (1, 4)) if quick else (2048, 512, (1, 64))
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(**shape, torch_dtype="bfloat16")
    hf = transformers.LlamaForCausalLM(hf_config).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        model, config = triton_model(Path(tmp), "bfloat16", device)
    hf = hf.to(device).eval()
    bandwidth = copy_bandwidth(device)
    row("speed: device copy bandwidth", "", f"{bandwidth / 1e9:.0f} GB/s")
    weight_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in
                                                                 [*model.parameters(), *model.buffers()]}.values())
    with torch.no_grad():
        for batch in batches:
            driver = Driver(model, config, batch, context + 64)
            step, graph = decode_step(driver, batch, context, device, device == "cuda")
            seconds = timed(step, device, 5 if quick else 50)
            row(f"speed: Kiln decode, batch {batch}, context {context}{' (CUDA graph)' if graph else ''}", "",
                f"{batch / seconds:.0f} tokens/s, {seconds * 1e3:.2f} ms/step")
            if batch == 1:
                kv = 2 * config.num_hidden_layers * context * config.num_key_value_heads * config.head_size * 2
                fraction = (weight_bytes + kv) / seconds / bandwidth
                row("speed: Kiln batch-1 decode / HBM roofline", "ok" if fraction >= 0.7 else "below",
                    f"{100 * fraction:.0f}% ({(weight_bytes + kv) / 1e9:.2f} GB/step; target >= 70%)")
            ids = torch.randint(0, 1000, (batch, 16), device=device)
            new = 8 if quick else 64
            hf_seconds = timed(lambda: hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                                   pad_token_id=0),
                               device, 1 if quick else 2)
            hf_rate = batch * new / hf_seconds
            row(f"speed: HF generate, batch {batch}", "", f"{hf_rate:.0f} tokens/s")
            if batch == batches[-1]:
                ratio = batch / seconds / hf_rate
                row(f"speed: Kiln / HF decode, batch {batch}", "ok" if ratio >= 5 else "below",
                    f"{ratio:.1f}x (target >= 5x)")
        driver = Driver(model, config, 1, prompt)
        seconds = timed(lambda: driver.prefill([list(range(prompt))]), device, 2 if quick else 10)
        row(f"speed: Kiln prefill, {prompt} tokens", "", f"{prompt / seconds:.0f} tokens/s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny speed model, one parity model (smoke run)")
    parser.add_argument("--sections", nargs="+", default=["kernels", "parity", "speed"])
    args = parser.parse_args()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("on CPU the Triton kernels run only in Triton's interpreter: set TRITON_INTERPRET=1")
    if args.device != "cpu":
        os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels (tests/conftest.py would ask for the interpreter)
    import triton

    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "none"
    print(f"gpu_check: {gpu}; torch {torch.__version__}; triton {triton.__version__}; "
          f"CPU {platform.processor() or '?'}; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    start = time.time()
    if "kernels" in args.sections:
        check_kernels(args.device)
    if "parity" in args.sections:
        check_parity(args.device, ["llama3.2"] if args.quick else ["llama3.2", "qwen2.5", "gemma2", "mixtral"])
    if "speed" in args.sections:
        check_speed(args.device, args.quick)
    print(f"\n{'check':<58} {'result':<8} figure  ({time.time() - start:.0f} s)")
    for what, result, figure in ROWS:
        print(f"{what:<58} {result:<8} {figure}")


if __name__ == "__main__":
    main()
