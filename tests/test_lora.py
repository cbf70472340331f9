"""LoRA adapters from Hugging Face PEFT, several in one batch with base-model requests, against HF's
PeftModel (float32, greedy)."""
import pytest
import torch

NEW_TOKENS = 16
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (r, lora_alpha, target_modules, use_rslora): different ranks, modules and scalings
ADAPTERS = {"qv": (4, 8, ["q_proj", "v_proj"], False), "all": (8, 16, ALL, True),
            "mlp": (2, 4, ["o_proj", "gate_proj", "up_proj", "down_proj", "k_proj"], False)}
MODULES = ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h", "mlp_gate"]


def save_adapter(base_dir, out, r, alpha, targets, rslora=False, seed=0, **extra):
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, **extra)
    model = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # PEFT starts B at zero: an adapter that changes nothing
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory):
    base = hf_model("llama")
    root = tmp_path_factory.mktemp("adapters")
    return {name: save_adapter(base, root / name, *spec, seed=i) for i, (name, spec) in enumerate(ADAPTERS.items())}


def _peft_greedy(base_dir, adapter_dir, prompt):
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    out = model.eval().generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def mixed(hf_model, adapters):
    """Prompts, their adapters (None: the base model) and what HF's PeftModel generates for each."""
    from kiln import LoRARequest

    base = hf_model("llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (5, 19, 11, 27, 8, 14)]
    prompts[4:] = [prompts[3]] * 2  # one prompt under three adapters: its blocks must not be shared
    names = ["qv", None, "all", "mlp", "qv", None]
    want = [_peft_greedy(base, None if n is None else adapters[n], p) for p, n in zip(prompts, names)]
    assert len({tuple(w) for w in want[3:]}) == 3, "the adapters change nothing HF generates"
    ids = {n: i + 1 for i, n in enumerate(ADAPTERS)}
    return prompts, [None if n is None else LoRARequest(n, ids[n], str(adapters[n])) for n in names], want


def _generate_mixed(engine_dir, prompts, loras, runtime=True):
    """The prompts in one batch, twice, with two slots for three adapters (one waits for a slot) and a
    KV pool that preempts; then prompt 3 again under its adapter, served from the prefix cache, and
    under prompt 4's adapter right after, which must not be (blocks are keyed by adapter).
    runtime=False: the first batch alone (the kernels' check, where the runtime's is done already)."""
    from kiln import LLM, SamplingParams

    llm = LLM(engine_dir, skip_tokenizer_init=True, max_loras=2, max_cpu_loras=1, max_tokens_in_paged_kv_cache=96)
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)  # EOS masked, as HF

        def generate(ps, ls):
            return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params,
                                                                lora_request=ls)]

        runs = [generate(prompts, loras) for _ in range(2 if runtime else 1)]
        if not runtime:
            return runs[0]
        assert runs[0] == runs[1]
        assert llm.llm_engine.get_stats()["num_preemptions"] > 0
        assert generate(prompts[3:4], loras[3:4]) == runs[0][3:4]
        hits = llm.llm_engine.get_stats()["prefix_cache_hits"]
        assert generate(prompts[3:4], loras[3:4]) == runs[0][3:4]
        assert llm.llm_engine.get_stats()["prefix_cache_hits"] >= hits + 3 * 8  # its three full blocks
        hits = llm.llm_engine.get_stats()["prefix_cache_hits"]
        assert generate(prompts[4:5], loras[4:5]) == runs[0][4:5]
        assert llm.llm_engine.get_stats()["prefix_cache_hits"] == hits
        return runs[0]
    finally:
        llm.llm_engine.shutdown()


LORA_BUILD = {"max_lora_rank": 8, "lora_target_modules": MODULES}


@pytest.mark.parametrize("backend", ["eager", "aoti", "triton"])
def test_adapters_mixed_with_base_requests_match_peft(backend, engine, mixed):
    """eager: the dense updates traced inline; aoti on the C++ GEMM plugin: kiln_cpp::lora's segmented ones;
    triton: the GPU op set's shrink/expand kernels (kiln/plugins/gpu/lora.py), in Triton's interpreter."""
    prompts, loras, want = mixed
    overrides = {"aoti": {"plugin_config": {"gemm_plugin": "cpp"}}, "triton": {"kernels": "triton"}}.get(backend, {})
    engine_dir = engine("llama", "eager" if backend == "triton" else backend, lora_config=LORA_BUILD, **overrides)
    assert _generate_mixed(engine_dir, prompts, loras, runtime=backend != "triton") == want


def check_segmented(dtype: torch.dtype) -> None:
    """kiln_cpp::lora against the inline path, on a fused qkv output: three pools at their columns,
    slots of different ranks (one empty), base-model tokens between, padding rows past a rank ignored."""
    from kiln.models.lora import StepAdapters
    from kiln.plugins import cpp

    cpp.load()
    g = torch.Generator().manual_seed(0)
    T, k, slots, max_rank, outs = 37, 100, 3, 8, {"attn_q": 96, "attn_k": 40, "attn_v": 40}
    ranks = torch.tensor([8, 3, 0])
    pools = {m: torch.zeros(2, slots, max_rank, k + n) for m, n in outs.items()}
    for pool in pools.values():
        for s in range(slots):
            pool[:, s, :ranks[s]] = torch.randn(2, int(ranks[s]), pool.shape[-1], generator=g)
    pools = {m: p.to(dtype) for m, p in pools.items()}
    x, base = torch.randn(T, k, generator=g).to(dtype), torch.randn(T, 176, generator=g).to(dtype)
    lora_slots = torch.randint(-1, slots, (T,), generator=g)
    columns = [("attn_q", 0), ("attn_k", 96), ("attn_v", 136)]
    want = StepAdapters(lora_slots, ranks, pools, segmented=False)(1, base, x, *columns).float()
    got = StepAdapters(lora_slots, ranks, pools, segmented=True)(1, base, x, *columns).float()
    tol = 1e-5 if dtype == torch.float32 else 1 / 64  # the bf16 paths round the update, or its rank sums, first
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    assert torch.equal(got[lora_slots == -1], base[lora_slots == -1].float())
    # a slot's rows past its rank are not read: garbage there changes nothing
    for pool in pools.values():
        pool[:, 1, 3:] = float("nan")
    assert torch.equal(StepAdapters(lora_slots, ranks, pools, segmented=True)(1, base, x, *columns).float(), got)
    torch.library.opcheck(torch.ops.kiln_cpp.lora.default,
                          (base, x, lora_slots, ranks, [p[0] for p in pools.values()], [0, 96, 136]))


# native: AVX512_BF16's vdpbf16ps kernel for bf16 (csrc/lora_bf16.cpp) where the CPU has it; the
# generic kernel (csrc/lora_kernel.h) as ATen's AVX-512, AVX2 and default builds compile it
ISAS = {"native": {}, "avx512": {"KILN_CPU_ISA": "avx512"}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
        "default": {"ATEN_CPU_CAPABILITY": "default"}}


@pytest.mark.parametrize("isa", list(ISAS))
def test_segmented_op_matches_dense_updates(isa):
    import os
    import subprocess
    import sys

    if isa == "native":
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            check_segmented(dtype)
        return
    script = "import torch, test_lora\nfor d in (torch.float32, torch.bfloat16): test_lora.check_segmented(d)"
    env = {**os.environ, **ISAS[isa], "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__),
                                                                       os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("args, message", [
    (dict(lora_slots=torch.full((4,), 3)), "token 0 has slot 3; the pools hold 2"),
    (dict(lora_ranks=torch.tensor([9, 0])), "slot 0 has rank 9, the pools hold 8"),
    (dict(offsets=[40]), "pool 0's 32 outputs at column 40 do not fit base's 64"),
    (dict(x=torch.randn(4, 16, dtype=torch.float64)), "x must be base's dtype"),
])
def test_segmented_op_bad_inputs(args, message):
    from kiln.plugins import cpp

    cpp.load()
    call = {**dict(base=torch.zeros(4, 64), x=torch.zeros(4, 16), lora_slots=torch.zeros(4, dtype=torch.int64),
                   lora_ranks=torch.tensor([8, 0]), pools=[torch.zeros(2, 8, 48)], offsets=[0]), **args}
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(")):
        torch.ops.kiln_cpp.lora(*call.values())


@pytest.mark.parametrize("heads, kv_heads, tp", [(8, 8, 2), (8, 2, 4), (8, 1, 4), (4, 2, 4)])
def test_rank_split_is_the_checkpoints(heads, kv_heads, tp):
    """Each rank's share of an adapter is the rows and columns of the base linears that the rank's
    checkpoint holds, KV heads replicated where there are fewer than tp ranks."""
    from kiln.config import Mapping, PretrainedConfig
    from kiln.layout import output_ranges
    from kiln.lora.adapter import Adapter
    from kiln.lora.shard import rank_weights
    from kiln.models.lora import module_shapes

    cfg = PretrainedConfig("LlamaForCausalLM", "float32", 64, 64, 1, heads, kv_heads, 64 // heads, 96, 128,
                           mapping=Mapping(world_size=tp, tp_size=tp))
    shapes = module_shapes(PretrainedConfig(**{**cfg.__dict__, "mapping": Mapping()}))
    # A's columns and B's rows numbered, so that a share names the ones it kept.
    weights = {(0, m): (torch.arange(i).float().expand(2, i), torch.arange(o).float()[:, None].expand(o, 2))
               for m, (i, o) in shapes.items()}
    adapter = Adapter(None, 2, 1.0, MODULES, weights)
    q_out, kv_out = heads * cfg.head_size, kv_heads * cfg.head_size
    for r in range(tp):
        (q, k, v), mlp = output_ranges(cfg, "attention.qkv", r), output_ranges(cfg, "mlp.fc", r)[0]
        rows = {"attn_q": q, "attn_k": (k[0] - q_out, k[1] - q_out),
                "attn_v": (v[0] - q_out - kv_out, v[1] - q_out - kv_out), "mlp_h_to_4h": mlp, "mlp_gate": mlp}
        share = rank_weights(adapter, cfg, {"max_lora_rank": 2, "lora_target_modules": MODULES}, r)
        for m, [(a, b)] in share.items():
            if m in rows:
                assert b[:, 0].tolist() == list(range(*rows[m])), (m, r)
            else:  # row-parallel: A's input columns, an even split
                part = shapes[m][0] // tp
                assert a[0].tolist() == list(range(r * part, (r + 1) * part)), (m, r)


def test_tp2_matches_peft(hf_model, mixed, tmp_path):
    from conftest import TEST_BUILD
    from kiln.build.builder import build_engine
    from kiln.config import BuildConfig
    from kiln.convert.cli import convert_checkpoint

    prompts, loras, want = mixed
    ckpt = convert_checkpoint(hf_model("llama"), tmp_path / "ckpt", dtype="float32", tp_size=2)
    e = build_engine(ckpt, tmp_path / "engine", BuildConfig(**{**TEST_BUILD, "backend": "eager",
                                                               "lora_config": LORA_BUILD}), log=lambda *_: None)
    assert _generate_mixed(e, prompts, loras) == want


def test_bad_adapters_fail_their_request_alone(engine, hf_model, adapters, tmp_path):
    from kiln import LLM, LoRARequest, SamplingParams

    base = hf_model("llama")
    bad = {
        "rank 16 exceeds the engine's max_lora_rank 8": save_adapter(base, tmp_path / "r16", 16, 16, ["q_proj"]),
        "modules_to_save=['lm_head'] is not supported": save_adapter(base, tmp_path / "save", 4, 8, ["q_proj"],
                                                                    modules_to_save=["lm_head"]),
        "use_dora=True is not supported": save_adapter(base, tmp_path / "dora", 4, 8, ["q_proj"], use_dora=True),
        "adapter_config.json not found": tmp_path,
    }
    e = engine("llama", lora_config=LORA_BUILD)
    narrow = engine("llama", lora_config={"max_lora_rank": 8, "lora_target_modules": ["attn_q", "attn_v"]})
    params = SamplingParams(temperature=0, max_tokens=4)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    for engine_dir, cases in ((e, bad), (narrow, {
            "adapts attn_dense, attn_k, mlp_4h_to_h, mlp_gate, mlp_h_to_4h, which the engine was not built for":
            adapters["all"]})):
        llm = LLM(engine_dir, skip_tokenizer_init=True)
        try:
            for i, (message, path) in enumerate(cases.items()):
                with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
                    llm.generate(prompt, params, lora_request=LoRARequest("bad", 10 + i, str(path)))
            # the engine is fine after: the base model and a good adapter
            good = llm.generate([prompt, prompt], params,
                                lora_request=[None, LoRARequest("qv", 1, str(adapters["qv"]))])
            assert all(len(o.outputs[0].token_ids) == 4 for o in good)
        finally:
            llm.llm_engine.shutdown()
    plain = LLM(engine("llama"), skip_tokenizer_init=True)
    try:
        with pytest.raises(ValueError, match="the engine was built without adapters"):
            plain.generate(prompt, params, lora_request=LoRARequest("qv", 1, str(adapters["qv"])))
    finally:
        plain.llm_engine.shutdown()


def test_kiln_serve_serves_adapters_as_models(engine, hf_model, adapters, mixed, tmp_path):
    import httpx
    import openai

    from test_serve import Server

    prompts, loras, want = mixed
    e = engine("llama", lora_config=LORA_BUILD)
    server = Server(e, tmp_path / "server.log", "--served-model-name", "base", "--lora-modules",
                    f"qv={adapters['qv']}", "--lora-modules", f'{{"name": "all", "path": "{adapters["all"]}"}}',
                    "--max-loras", "2", "--allow-runtime-lora-updating")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"base", "qv", "all"} and models["qv"].parent == "base"

        def complete(model, i):
            out = client.completions.create(model=model, prompt=prompts[i], max_tokens=NEW_TOKENS, temperature=0,
                                            extra_body={"min_tokens": NEW_TOKENS, "return_token_ids": True})
            return out.choices[0].token_ids

        assert [complete("qv", 0), complete("base", 1), complete("all", 2)] == want[:3]
        with pytest.raises(openai.NotFoundError, match="The model `mlp` does not exist"):
            complete("mlp", 3)
        # vLLM's runtime endpoints: a bad adapter is a 400, the server serving on
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
        assert r.status_code == 400 and "adapter_config.json not found" in r.text
        r = httpx.post(f"{server.url}/v1/load_lora_adapter",
                       json={"lora_name": "mlp", "lora_path": str(adapters["mlp"])})
        assert r.status_code == 200, r.text
        assert complete("mlp", 3) == want[3]
        metrics = server.metrics()
        assert (metrics["kiln:lora_adapters_loaded"], metrics["kiln:max_loras"]) == (2, 2)
        assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            complete("mlp", 3)
    finally:
        server.stop()


def test_triton_lora_task_ids(engine, adapters, mixed, tmp_path):
    """TensorRT-LLM's protocol: the first request of a task sends lora_weights and lora_config (as
    `kiln lora convert` writes them), later ones the lora_task_id alone, on tensorrt_llm and through the
    ensemble; an unknown id is an error naming it, and the server keeps serving."""
    import httpx
    import numpy as np
    from click.testing import CliRunner

    from kiln import LLM, LoRARequest, SamplingParams
    from kiln.cli import cli
    from tiny_models import PROMPTS
    from triton_client import Stream, Triton, engine_inputs, grpc_inputs

    prompts, _, want = mixed
    e = engine("llama", lora_config=LORA_BUILD)
    runner = CliRunner()
    result = runner.invoke(cli, ["lora", "convert", "--lora_dir", str(adapters["qv"]), "--model_dir", str(e),
                                 "--output_dir", str(tmp_path / "qv")])
    assert result.exit_code == 0, result.output
    weights, config = (np.load(tmp_path / "qv" / f"model.lora_{name}.npy") for name in ("weights", "config"))
    assert weights.dtype == np.float16 and config.shape[2] == 3
    result = runner.invoke(cli, ["triton-repo", "--engine_dir", str(e), "--output_dir", str(tmp_path / "repo")])
    assert result.exit_code == 0, result.output
    server = Triton(tmp_path / "repo", tmp_path / "server.log")
    stream = Stream(server)
    try:

        def generate(prompt, **lora):
            inputs = engine_inputs(prompt, NEW_TOKENS, min_tokens=NEW_TOKENS, exclude_input_in_output=True)
            out = stream.call("tensorrt_llm", inputs + grpc_inputs(**lora))
            return out.as_numpy("output_ids")[0, 0, :NEW_TOKENS].tolist()

        task = {"lora_task_id": np.array([[7]], np.uint64)}
        # fp16 weights: the first tokens as PEFT's float32 (a later one may differ by the rounding)
        first = generate(prompts[0], **task, lora_weights=weights, lora_config=config)
        assert first[:4] == want[0][:4]
        assert generate(prompts[0], **task) == first  # the id alone: the cached adapter
        assert generate(prompts[1]) == want[1]  # the base model beside it
        with pytest.raises(Exception, match="lora_task_id 8 is not cached"):
            generate(prompts[0], lora_task_id=np.array([[8]], np.uint64))
        with pytest.raises(Exception, match="rank 16 exceeds|lora_config"):
            generate(prompts[0], lora_task_id=np.array([[9]], np.uint64), lora_weights=weights,
                     lora_config=np.where(np.arange(3) == 2, 16, config).astype(np.int32))
        assert generate(prompts[0], **task) == first
        # through the ensemble (text in, text out) the cached task alone, as the LLM API runs the converted dir
        body = {"text_input": PROMPTS[0], "max_tokens": 8, "exclude_input_in_output": True}
        text = httpx.post(f"{server.url}/v2/models/ensemble/generate", json={**body, "lora_task_id": 7}, timeout=60)
        assert text.status_code == 200, text.text
        llm = LLM(e)
        try:
            ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8),
                               lora_request=LoRARequest("qv_fp16", 1, str(tmp_path / "qv")))[0].outputs[0].text
        finally:
            llm.llm_engine.shutdown()
        assert text.json()["text_output"] == ref
        assert httpx.post(f"{server.url}/v2/models/ensemble/generate", json=body).json()["text_output"] != ref
    finally:
        stream.close()
        server.stop()


def test_engine_build_takes_tensorrt_llm_flags(checkpoint, tmp_path):
    """`--lora_target_modules attn_q attn_v` as TensorRT-LLM's trtllm-build takes it (names after one flag)."""
    import json

    from click.testing import CliRunner

    from kiln.build.cli import main

    ckpt = str(checkpoint("llama"))
    result = CliRunner().invoke(main, ["--checkpoint_dir", ckpt, "--output_dir", str(tmp_path / "e"), "--backend", "eager",
                                       "--lora_plugin", "auto", "--lora_target_modules", "attn_q", "attn_v",
                                       "mlp_4h_to_h", "--max_lora_rank", "4", "--max_batch_size", "2"])
    assert result.exit_code == 0, result.output
    lora = json.loads((tmp_path / "e" / "config.json").read_text())["build_config"]["lora_config"]
    assert lora == {"max_lora_rank": 4, "lora_target_modules": ["attn_q", "attn_v", "mlp_4h_to_h"]}
    result = CliRunner().invoke(main, ["--checkpoint_dir", ckpt, "--output_dir", str(tmp_path / "f"),
                                       "--lora_target_modules", "attn_q"])
    assert result.exit_code != 0 and "--lora_target_modules needs --lora_plugin auto" in result.output
