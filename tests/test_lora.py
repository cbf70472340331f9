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


def _generate_mixed(engine_dir, prompts, loras):
    """The prompts in one batch, twice (the second time from the prefix cache, whose blocks are keyed by
    adapter); two slots for three adapters (one waits for a slot), a KV pool that preempts."""
    from kiln import LLM, SamplingParams

    llm = LLM(engine_dir, skip_tokenizer_init=True, max_loras=2, max_cpu_loras=1, max_tokens_in_paged_kv_cache=96)
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)  # EOS masked, as HF
        runs = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             lora_request=loras)] for _ in range(2)]
        assert runs[0] == runs[1]
        return runs[0]
    finally:
        llm.llm_engine.shutdown()


LORA_BUILD = {"max_lora_rank": 8, "lora_target_modules": MODULES}


@pytest.mark.parametrize("backend", ["eager", "aoti"])
def test_adapters_mixed_with_base_requests_match_peft(backend, engine, mixed):
    prompts, loras, want = mixed
    assert _generate_mixed(engine("llama", backend, lora_config=LORA_BUILD), prompts, loras) == want


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
