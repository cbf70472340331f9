"""TensorRT-LLM's users' own command lines, as its docs print them (paths replaced): convert_checkpoint.py
and trtllm-build, each in a fresh subprocess under Kiln's names for the two commands, each engine then
generating. And every kind of engine, eager and aoti, loaded and generating in an interpreter that
imports nothing first, so that no test passes only because its process had registered every op."""
import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from test_lora import save_adapter

BIN = Path(sys.executable).parent
# (where the lines come from, convert_checkpoint.py line, trtllm-build line). {model}: the tiny HF model;
# {ckpt}, {engine}: the dirs the lines name; {lora_a}, {lora_b}: PEFT adapters. Build lines are paired
# with a convert line of another section where that covers more in one engine.
LLAMA_README = "TensorRT-LLM/examples/models/core/llama/README.md (0.18+)"
DOCS = {
    "bf16": (LLAMA_README + ", single GPU BF16",
             "python convert_checkpoint.py --model_dir {model} --output_dir {ckpt} --dtype bfloat16",
             "trtllm-build --checkpoint_dir {ckpt} --output_dir {engine} --gemm_plugin auto"),
    "int4_long_context": (
        "TensorRT-LLM/examples/models/contrib/hyperclovax/README.md (INT4 weight-only); the llama README, long context",
        "python ../../core/llama/convert_checkpoint.py --model_dir {model} --output_dir {ckpt} "
        "--use_weight_only --weight_only_precision int4 --dtype float16",
        "python -m tensorrt_llm.commands.build --checkpoint_dir {ckpt} --output_dir {engine} --gemm_plugin float16 "
        "--gather_context_logits --max_num_tokens 4096 --max_input_len 16384 --max_seq_len 16394 "
        "--use_paged_context_fmha enable"),
    "int8_kv_int8_wo": (
        LLAMA_README + ", INT8 weight-only and INT8 KV cache",
        "python convert_checkpoint.py --model_dir {model} --output_dir {ckpt} --dtype float16 --int8_kv_cache "
        "--use_weight_only --weight_only_precision int8",
        "trtllm-build --checkpoint_dir {ckpt} --output_dir {engine} --gemm_plugin auto"),
    "smoothquant": (
        LLAMA_README + ", SmoothQuant",
        "python3 convert_checkpoint.py --model_dir {model}  --output_dir {ckpt} --dtype float16 --smoothquant 0.5",
        "trtllm-build --checkpoint_dir {ckpt} --output_dir {engine} --gemm_plugin auto"),
    "mixtral_ep": (
        "TensorRT-LLM/examples/models/core/mixtral/README.md, expert parallelism",
        "python ../llama/convert_checkpoint.py --model_dir {model} --output_dir {ckpt} --dtype float16 "
        "--tp_size 2 --moe_ep_size 2",
        "trtllm-build --checkpoint_dir {ckpt} --output_dir {engine} --gemm_plugin float16"),
    "lora": (
        LLAMA_README + ", FP16 single GPU; multi-LoRA with target modules",
        "python convert_checkpoint.py --model_dir {model} --output_dir {ckpt} --dtype float16",
        "trtllm-build --checkpoint_dir {ckpt} --output_dir {engine} --gemm_plugin auto --lora_plugin auto "
        "--max_batch_size 8 --max_input_len 512 --max_seq_len 562 --lora_dir  \"{lora_a}\" \"{lora_b}\" "
        "--max_lora_rank 8 --lora_target_modules attn_q attn_k attn_v"),
    "eagle": (
        "TensorRT-LLM/examples/eagle/README.md (an EAGLE-3 draft in place of its EAGLE-1 one)",
        "python convert_checkpoint.py --model_dir {model} --eagle_model_dir {draft} --output_dir {ckpt} "
        "--dtype float16 --max_draft_len 63 --num_eagle_layers 4 --max_non_leaves_per_layer 10",
        "trtllm-build --checkpoint_dir {ckpt} --output_dir {engine} --gemm_plugin float16 "
        "--use_paged_context_fmha enable --speculative_decoding_mode eagle --max_batch_size 4"),
}
MODEL_OF = {"mixtral_ep": "mixtral", "eagle": "llama_4layers"}
PROMPTS = [[5, 17, 33, 8], [100, 7, 250, 3, 99, 12]]
# Run in `python -c` by a fresh interpreter: argv[1] is {"engine", "args", "lora", "prompts", "api"}.
GENERATE = """
import json, sys
spec = json.loads(sys.argv[1])
if spec.get("api") == "async":
    import asyncio
    from kiln import AsyncLLM, SamplingParams

    async def main():
        llm = AsyncLLM(spec["engine"], **spec.get("args", {}))
        try:
            outs = []
            for i, p in enumerate(spec["prompts"]):
                async for out in llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=8, temperature=0,
                                              ignore_eos=True), f"r{i}"):
                    pass
                outs.append(out.outputs[0].token_ids)
            return outs
        finally:
            llm.shutdown()
    print(json.dumps(asyncio.run(main())))
else:
    from kiln import LLM, LoRARequest, SamplingParams

    llm = LLM(spec["engine"], **spec.get("args", {}))
    lora = LoRARequest("a", 1, spec["lora"]) if spec.get("lora") else None
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), lora_request=lora)
    print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def run(argv: list[str], timeout: float = 600, stderr: bool = False) -> str:
    """The command's output (and its log on stderr too, if asked); it must succeed."""
    env = dict(os.environ, PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{shlex.join(argv)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + (proc.stderr if stderr else "")


def as_kiln(line: str, paths: dict) -> list[str]:
    """A documented line with Kiln's commands in place of TensorRT-LLM's scripts, paths filled in."""
    argv = shlex.split(line.format(**{k: str(v) for k, v in paths.items()}))
    if argv[0].startswith("python"):
        script = argv[1] if argv[1] != "-m" else argv[2]
        argv = argv[3:] if argv[1] == "-m" else argv[2:]
        command = "engine-build" if script.endswith(("build", "build.py")) else "convert_checkpoint"
    else:
        command, argv = {"trtllm-build": "engine-build"}[argv[0]], argv[1:]
    return [str(BIN / command), *argv]


def generate_fresh(engine_dir, api: str = "llm", **spec) -> list[list[int]]:
    """Token ids a new interpreter generates, having imported nothing before kiln."""
    out = run([sys.executable, "-c", GENERATE, json.dumps({"engine": str(engine_dir), "api": api,
                                                           "prompts": PROMPTS, **spec})])
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def lora_dirs(hf_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("doc_adapters")
    base = hf_model("llama")
    return {"lora_a": save_adapter(base, root / "luotuo", 4, 8, ["q_proj", "v_proj"], seed=1),
            "lora_b": save_adapter(base, root / "japanese", 8, 16, ["q_proj", "k_proj", "v_proj"], seed=2)}


@pytest.fixture(scope="module")
def doc_engines(hf_model, lora_dirs, tmp_path_factory) -> dict:
    """name -> (engine dir, the commands' output): each documented pair run as its users type it."""
    from eagle3_drafts import make_draft

    root = tmp_path_factory.mktemp("doc_lines")
    eagle_target = hf_model(MODEL_OF["eagle"])
    draft = make_draft(root / "eagle3_draft", json.loads((eagle_target / "config.json").read_text()))

    def build(name):
        _, convert, build_line = DOCS[name]
        paths = dict(model=hf_model(MODEL_OF.get(name, "llama")), ckpt=root / name / "ckpt",
                     engine=root / name / "engine", draft=draft, **lora_dirs)
        out = run(as_kiln(convert, paths), stderr=True)
        return paths["engine"], out + run(as_kiln(build_line, paths))

    with ThreadPoolExecutor(2) as pool:  # two commands at a time: each waits on its own compiler
        return dict(zip(DOCS, pool.map(build, DOCS)))


def generate_here(engine_dir, lora=None) -> list[list[int]]:
    from kiln import LLM, LoRARequest, SamplingParams

    llm = LLM(engine_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=8, temperature=0,
                        ignore_eos=True), lora_request=lora and LoRARequest("a", 1, str(lora)))
    llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", list(DOCS))
def test_documented_lines_build_engines_that_generate(name, doc_engines, fresh):
    """The engines among the kinds were generated from in fresh interpreters; the others here."""
    engine_dir, output = doc_engines[name]
    tokens = fresh[DOC_KINDS[name]] if name in DOC_KINDS else generate_here(engine_dir)
    assert [len(t) for t in tokens] == [8, 8]
    config = json.loads((engine_dir / "config.json").read_text())
    build, pretrained = config["build_config"], config["pretrained_config"]
    assert build["backend"] == "aoti" and build["plugin_config"]["gemm_plugin"] == "cpp"  # auto / a dtype: on
    if name == "int4_long_context":
        assert pretrained["quantization"]["quant_algo"] == "W4A16" and pretrained["dtype"] == "float16"
        assert build["max_seq_len"] == 16394 and build["max_num_tokens"] == 4096
        assert "max_seq_len 16394 is larger than max_position_embeddings 256" in output
        assert "--gather_context_logits True: no build flag needed" in output
    if name == "smoothquant":
        assert pretrained["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL"
        assert "calibrating int8_sq (alpha 0.5)" in output
    if name == "int8_kv_int8_wo":
        assert pretrained["quantization"] == {**pretrained["quantization"], "quant_algo": "W8A16",
                                              "kv_cache_quant_algo": "INT8"}
    if name == "mixtral_ep":
        assert pretrained["mapping"]["moe_ep_size"] == 2 and pretrained["mapping"]["world_size"] == 2
    if name == "eagle":
        assert build["speculative_decoding_mode"] == "eagle3" and build["hidden_state_layers"] == [0, 1, 2]
        assert "--num_eagle_layers: Kiln's EAGLE-3 drafts a chain" in output
        assert "--speculative_decoding_mode eagle: an engine built from a checkpoint with an EAGLE-3 draft" in output
        spec = {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 3}}
        assert generate_fresh(engine_dir, args=spec) == tokens  # greedy: what the engine emits without drafts
    if name == "lora":
        assert build["lora_config"] == {"max_lora_rank": 8, "lora_target_modules": ["attn_q", "attn_k", "attn_v"]}
        assert generate_here(engine_dir, lora=None) != tokens  # the adapter changes what is generated


GUIDE = ("python convert_checkpoint.py --model_dir {model} --output_dir {ckpt} --dtype bfloat16 "
         "--tp_size 4 --pp_size 1 --use_fp8",
         "trtllm-build --checkpoint_dir {ckpt} --output_dir {engine} --gemm_plugin auto "
         "--max_batch_size 64 --max_input_len 4096 --max_seq_len 8192 "
         "--paged_kv_cache enable --use_paged_context_fmha enable --workers 4")
# The guide's Triton model config for tensorrt_llm, in a repository of that model alone.
GUIDE_TRITON = """name: "tensorrt_llm"
backend: "tensorrtllm"
max_batch_size: 64

model_transaction_policy {
  decoupled: True
}

parameters: {
  key: "gpt_model_path"
  value: {
    string_value: "%s"
  }
}
parameters: {
  key: "batching_type"
  value: {
    string_value: "inflight"
  }
}
parameters: {
  key: "max_tokens_in_paged_kv_cache"
  value: {
    string_value: "131072"
  }
}
"""


@pytest.fixture(scope="module")
def guide_engine(tmp_path_factory):
    """The production guide's two commands on the default model (its 1,024 positions, asked for 8,192:
    kept, with trtllm-build's warning); (engine dir, engine-build's output, what a fresh interpreter
    generates from it)."""
    root = tmp_path_factory.mktemp("guide")
    paths = dict(model=Path(__file__).resolve().parent.parent / "models" / "kiln-tiny-stdlib",
                 ckpt=root / "checkpoint_fp8", engine=root / "engine_fp8")
    run(as_kiln(GUIDE[0], paths))
    out = run(as_kiln(GUIDE[1], paths))
    return paths["engine"], out, generate_fresh(paths["engine"])


def test_the_production_guide_pipeline_verbatim(guide_engine):
    engine_dir, out, tokens = guide_engine
    assert "warning: max_seq_len 8192 is larger than max_position_embeddings 1024" in out
    assert "--paged_kv_cache enable: Kiln's KV cache is always paged" in out
    config = json.loads((engine_dir / "config.json").read_text())
    assert config["pretrained_config"]["quantization"]["quant_algo"] == "FP8"
    assert config["pretrained_config"]["mapping"]["tp_size"] == 4 and config["build_config"]["max_seq_len"] == 8192
    assert [len(t) for t in tokens] == [8, 8]


def test_the_guides_engine_under_kiln_serve_and_its_triton_config(guide_engine, tmp_path):
    """`kiln serve` answers a completion; a repository of the guide's tensorrt_llm config.pbtxt alone
    (backend tensorrtllm, no inputs or outputs declared) loads under `kiln triton-serve` and streams the
    same tokens to tritonclient."""
    import httpx

    from test_serve import Server
    from triton_client import Stream, Triton, engine_inputs

    engine_dir, _, tokens = guide_engine
    prompt, want = PROMPTS[1], tokens[1]
    serve = Server(engine_dir, tmp_path / "serve.log")
    try:
        body = {"model": str(engine_dir), "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        choice = httpx.post(f"{serve.url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert choice["token_ids"] == want
    finally:  # SIGTERM: the server drains and its rank workers go with it
        serve.proc.terminate()
        serve.proc.wait(timeout=60)
    model = tmp_path / "repo" / "tensorrt_llm"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(GUIDE_TRITON % engine_dir)
    server = Triton(tmp_path / "repo", tmp_path / "triton.log")
    try:
        stream = Stream(server)
        stream.send("tensorrt_llm", engine_inputs(prompt, 8, streaming=True, end_id=-1))
        tokens = [t for r in stream.responses() for t in r.as_numpy("output_ids").reshape(-1).tolist()]
        stream.close()
        assert tokens == want
    finally:
        server.stop()


@pytest.mark.parametrize("argv, message", [
    (["--kv_cache_type", "continuous"], "only a paged KV cache is supported"),
    (["--paged_kv_cache", "disable"], "only a paged KV cache is supported"),
    (["--gemm_plugin", "nvfp4"], "NVFP4 GEMMs are not supported"),
    (["--streamingllm", "enable"], "StreamingLLM (attention sinks) is not supported"),
    (["--speculative_decoding_mode", "medusa"], "medusa decoding is not supported"),
    (["--max_prompt_embedding_table_size", "16"], "prompt tuning and multimodal input"),
    (["--lora_ckpt_source", "nemo"], "NeMo LoRA checkpoints are not supported"),
    (["--logits_dtype", "float16"], "float32 logits only"),
])
def test_engine_build_refuses_what_kiln_lacks_in_one_line(checkpoint, tmp_path, argv, message):
    from kiln.build.cli import main

    result = CliRunner().invoke(main, ["--checkpoint_dir", str(checkpoint("llama")), "--output_dir",
                                       str(tmp_path / "e"), "--backend", "eager", *argv])
    assert result.exit_code != 0 and message in result.output, result.output
    assert result.output.strip().splitlines()[-1].startswith("Error: --") and not (tmp_path / "e").exists()


@pytest.mark.parametrize("argv, message", [
    (["--use_fp8_rowwise"], "FP8 row-wise (per-token, per-channel) quantization is not supported"),
    (["--smoothquant", "0.5", "--per_token", "--per_channel"], "per-token activation scales is not supported"),
    (["--use_weight_only", "--weight_only_precision", "int8_gptq"], "int8 GPTQ is not supported"),
    (["--cp_size", "2"], "context parallelism is not supported"),
    (["--use_fp8", "--use_weight_only"], "choose one quantization"),
])
def test_convert_checkpoint_refuses_what_kiln_lacks_in_one_line(hf_model, tmp_path, argv, message):
    from kiln.convert.cli import main

    result = CliRunner().invoke(main, ["--model_dir", str(hf_model("llama")), "--output_dir", str(tmp_path / "c"),
                                       *argv])
    assert result.exit_code != 0 and message in result.output and not (tmp_path / "c").exists()


@pytest.fixture(scope="module")
def kinds(engine, doc_engines, hf_model, tmp_path_factory) -> dict:
    """(kind, backend) -> engine dir, one of every kind; the aoti ones mostly the documented lines'."""
    from test_lora import LORA_BUILD

    root = tmp_path_factory.mktemp("kinds")
    out = {("dense", "eager"): engine("llama"), ("moe", "eager"): engine("mixtral"),
           ("lora", "eager"): engine("llama", lora_config=LORA_BUILD),
           **{DOC_KINDS[name]: engine_dir for name, (engine_dir, _) in doc_engines.items() if name in DOC_KINDS}}
    int4, window = root / "int4_ckpt", root / "fp8kv_window_ckpt"
    run([str(BIN / "convert_checkpoint"), "--model_dir", str(hf_model("llama")), "--output_dir", str(int4),
         "--use_weight_only", "--weight_only_precision", "int4"])
    run([str(BIN / "convert_checkpoint"), "--model_dir", str(hf_model("mistral_window")), "--output_dir", str(window),
         "--fp8_kv_cache", "--calib_size", "16"])
    for name, ckpt, backends in (("int4", int4, ["eager"]), ("fp8kv_window", window, ["eager", "aoti"])):
        for backend in backends:
            out[(name, backend)] = root / f"{name}_{backend}"
            run([str(BIN / "engine-build"), "--checkpoint_dir", str(ckpt), "--output_dir", str(out[(name, backend)]),
                 "--backend", backend, "--max_batch_size", "4", "--max_seq_len", "256", "--max_num_tokens", "256",
                 "--max_input_len", "128"])  # a draft's max_seq_len: at least its targets'
    return out


KINDS = [(k, b) for k in ("dense", "moe", "lora", "int4", "fp8kv_window", "draft") for b in ("eager", "aoti")]
# The documented lines' engines among the kinds.
DOC_KINDS = {"bf16": ("dense", "aoti"), "int4_long_context": ("int4", "aoti"), "mixtral_ep": ("moe", "aoti"),
             "lora": ("lora", "aoti")}


def kind_spec(kind: str, backend: str, kinds: dict, lora_dirs: dict) -> tuple[Path, dict, str | None]:
    """(engine dir, LLM keyword arguments, LoRA adapter dir) of a kind."""
    args, lora = {}, None
    if kind == "draft":  # the windowed fp8-KV engine drafting for the dense one
        args["speculative_config"] = {"method": "draft_model", "num_speculative_tokens": 3,
                                      "draft_engine_dir": str(kinds[("fp8kv_window", backend)])}
    if kind == "lora":
        lora = str(lora_dirs["lora_a"])
    return kinds[("dense" if kind == "draft" else kind, backend)], args, lora


@pytest.fixture(scope="module")
def fresh(kinds, lora_dirs) -> dict:
    """(kind, backend) -> what a new interpreter generates from it, two interpreters at a time."""
    def one(key):
        engine_dir, args, lora = kind_spec(*key, kinds, lora_dirs)
        return generate_fresh(engine_dir, args=args, lora=lora)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(KINDS, pool.map(one, KINDS)))


@pytest.mark.parametrize("kind, backend", KINDS, ids=[f"{k}-{b}" for k, b in KINDS])
def test_every_kind_of_engine_loads_in_a_fresh_interpreter(kind, backend, kinds, lora_dirs, fresh):
    """LLM(engine) in a new interpreter generates what this process generates from the same engine."""
    from kiln import LLM, LoRARequest, SamplingParams

    engine_dir, args, lora = kind_spec(kind, backend, kinds, lora_dirs)
    llm = LLM(engine_dir, **args)
    want = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        lora_request=lora and LoRARequest("a", 1, lora))
    llm.llm_engine.shutdown()
    assert fresh[(kind, backend)] == [list(o.outputs[0].token_ids) for o in want]


def test_a_moe_eager_engine_through_every_entry_point(kinds, fresh):
    """The engine that once failed to deserialize in a fresh process: AsyncLLM and `kiln run` too."""
    engine_dir = kinds[("moe", "eager")]
    assert generate_fresh(engine_dir, api="async") == fresh[("moe", "eager")]
    out = run([str(BIN / "kiln"), "run", "--engine_dir", str(engine_dir), "--prompt", "import json",
               "--max_tokens", "4"])
    assert "import json" in out
