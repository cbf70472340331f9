"""Engines on the GPU op set as users reach them: `engine-build --kernels triton` typed in a fresh
process, loaded by another that imports nothing first, and the one-line errors of the device
options (no GPU here: a CUDA engine is refused, whichever way it is asked for)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require

require("triton", "OpenAI Triton is not installed (pip install 'kiln-llm[gpu]')", module_level=True)

BIN = Path(sys.executable).parent
SIZES = ["--max_batch_size", "4", "--max_input_len", "64", "--max_seq_len", "96", "--max_num_tokens", "128",
         "--tokens_per_block", "8"]
GENERATE = """
import sys
from kiln import LLM, SamplingParams
llm = LLM(sys.argv[1])
out = llm.generate(["The capital of France is", "1, 2, 3,"], SamplingParams(temperature=0, max_tokens=6))
print([o.outputs[0].token_ids for o in out])
"""


def run(args, interpret=True, **kw):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, **kw)


def one_line_error(result, *fragments):
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def triton_engine(hf_model, checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("triton_engine") / "e"
    result = run([str(BIN / "engine-build"), "--checkpoint_dir", str(checkpoint("llama")), "--output_dir", str(out),
                  "--tokenizer_dir", str(hf_model("llama")), "--backend", "eager", "--kernels", "triton", *SIZES])
    assert result.returncode == 0, result.stderr
    return out


def test_a_triton_engine_built_and_served_from_fresh_processes_generates_the_cpu_kernels_tokens(
        triton_engine, engine, hf_model):
    config = json.loads((triton_engine / "config.json").read_text())["build_config"]
    assert config["kernels"] == "triton" and set(config["op_set"].values()) == {"triton"}
    cpu_engine = engine("llama")
    ours = run([sys.executable, "-c", GENERATE, str(triton_engine)])
    assert ours.returncode == 0, ours.stderr
    theirs = run([sys.executable, "-c", GENERATE.replace("LLM(sys.argv[1])", "LLM(sys.argv[1], tokenizer=sys.argv[2])"),
                  str(cpu_engine), str(hf_model("llama"))], interpret=False)
    assert theirs.returncode == 0, theirs.stderr
    assert ours.stdout == theirs.stdout


def test_a_triton_engine_outside_the_interpreter_is_a_one_line_error(triton_engine):
    result = run([str(BIN / "kiln"), "run", "--engine_dir", str(triton_engine), "--prompt", "hi"], interpret=False)
    one_line_error(result, "set TRITON_INTERPRET=1")


@pytest.mark.parametrize("options, fragments", [
    (["--device", "cuda"], ["--device cuda: no CUDA GPU is visible here", "--device cpu"]),
    (["--kernels", "triton"], ["--kernels triton on CPU needs --backend eager"]),  # aoti, the default backend
])
def test_device_and_kernel_options_get_one_line_errors(options, fragments, checkpoint, tmp_path):
    result = run([str(BIN / "engine-build"), "--checkpoint_dir", str(checkpoint("llama")), "--output_dir",
                  str(tmp_path / "e"), *SIZES, *options])
    one_line_error(result, *fragments)
    assert not (tmp_path / "e").exists()


def test_building_triton_kernels_outside_the_interpreter_is_a_one_line_error(checkpoint, tmp_path):
    result = run([str(BIN / "engine-build"), "--checkpoint_dir", str(checkpoint("llama")), "--output_dir",
                  str(tmp_path / "e"), "--backend", "eager", "--kernels", "triton", *SIZES], interpret=False)
    one_line_error(result, "set TRITON_INTERPRET=1")


def test_a_cuda_engine_on_a_machine_without_a_gpu_is_a_one_line_error(engine, tmp_path):
    import torch

    from kiln.config import ConfigError
    from kiln.engine.loader import RankEngine

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    copy = tmp_path / "cuda_engine"
    shutil.copytree(engine("llama"), copy)
    config = json.loads((copy / "config.json").read_text())
    config["build_config"].update(target_device="cuda", gpu_arch="sm_90")
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="built for a CUDA GPU and this machine has none .* --device cpu"):
        RankEngine(copy)
