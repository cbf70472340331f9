"""An engine built from a checkpoint with no tokenizer files (as ModelOpt's exports are): engine-build
says so; LLM(..., skip_tokenizer_init=True) and `kiln serve --skip-tokenizer-init` take token ids
and give token ids with empty text; without that flag the error names --tokenizer_dir."""
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from conftest import TEST_BUILD
from kiln import LLM, SamplingParams
from kiln.build.builder import build_engine
from kiln.build.cli import main as engine_build
from kiln.config import BuildConfig, ConfigError
from kiln.utils import free_ports

PROMPTS = [[5, 17, 42, 99], [7, 7, 300, 12, 8, 64, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def bare(checkpoint, tmp_path_factory):
    """(checkpoint dir without tokenizer files, engine dir built from it, engine-build's summary)."""
    root = tmp_path_factory.mktemp("bare")
    ckpt = root / "ckpt"
    ckpt.mkdir()
    for f in checkpoint("llama").iterdir():
        if f.name == "config.json" or f.name.startswith("rank"):
            shutil.copy(f, ckpt / f.name)
    lines = []
    out = build_engine(ckpt, root / "engine", BuildConfig(**{**TEST_BUILD, "backend": "eager"}), log=lines.append)
    return ckpt, out, lines[-1]


@pytest.fixture(scope="module")
def reference(engine):
    """The same weights with their tokenizer: what the token ids must be."""
    outs = LLM(engine("llama")).generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def test_build_summary_says_there_is_no_tokenizer(bare):
    ckpt, engine_dir, summary = bare
    assert summary.startswith("built eager engine in ") and summary.endswith(f"-> {engine_dir}")
    assert f"no tokenizer (none in {ckpt}; pass --tokenizer_dir <HF model dir>" in summary, summary


def test_tokenizer_dir_fixes_it(bare, hf_model, tmp_path):
    ckpt, _, _ = bare
    out = tmp_path / "engine"
    result = CliRunner().invoke(engine_build, ["--checkpoint_dir", str(ckpt), "--output_dir", str(out),
                                               "--backend", "eager", "--tokenizer_dir", str(hf_model("llama")),
                                               "--max_seq_len", "64", "--max_input_len", "32"])
    assert result.exit_code == 0, result.output
    assert f"tokenizer from {hf_model('llama')} -> {out}" in result.output.strip().splitlines()[-1]
    assert LLM(out).generate("import json", GREEDY)[0].outputs[0].text


def test_without_the_flag_the_error_names_tokenizer_dir(bare):
    _, engine_dir, _ = bare
    with pytest.raises(ConfigError) as err:
        LLM(engine_dir)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"engine dir {engine_dir} has no tokenizer (none of tokenizer.json")
    assert "engine-build --tokenizer_dir <HF model dir>" in message and "skip_tokenizer_init=True" in message


def test_skip_tokenizer_init_generates_token_ids(bare, reference):
    llm = LLM(bare[1], skip_tokenizer_init=True)
    assert llm.get_tokenizer() is None
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.outputs[0].text == "" and o.prompt_token_ids == p for o, p in zip(outs, PROMPTS))
    with pytest.raises(ValueError, match=r"^prompt is text, but this engine was loaded with skip_tokenizer_init"):
        llm.generate("import json", GREEDY)
    with pytest.raises(ValueError, match=r"^stop strings need a tokenizer"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=4, stop=["\n"]))


def _serve(engine_dir: Path, log: Path, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_ports(1)[0]
    proc = subprocess.Popen([str(Path(sys.executable).parent / "kiln"), "serve", "--engine_dir", str(engine_dir),
                             "--host", "127.0.0.1", "--port", str(port), "--threads", "1", "--no_access_log", *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return proc, url


def test_serve_skip_tokenizer_init(bare, reference, tmp_path):
    proc, url = _serve(bare[1], tmp_path / "serve.log", "--skip-tokenizer-init")
    try:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        body = {"prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["token_ids"] for c in choices] == reference
        assert [c["prompt_token_ids"] for c in choices] == PROMPTS and all(c["text"] == "" for c in choices)

        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "prompt": PROMPTS[1], "stream": True},
                          timeout=60) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == reference[1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        for path, payload in (("/v1/completions", {"prompt": "import json"}),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = httpx.post(f"{url}{path}", json=payload, timeout=60)
            assert r.status_code == 400 and "--skip-tokenizer-init" in r.json()["error"]["message"], r.text
    finally:
        proc.kill()
        proc.wait()


def test_serve_without_the_flag_names_tokenizer_dir(bare, tmp_path):
    proc, _ = _serve(bare[1], tmp_path / "serve.log")
    try:
        assert proc.wait(timeout=120) == 1
    finally:
        proc.kill()
        proc.wait()
    log = (tmp_path / "serve.log").read_text()
    assert "has no tokenizer" in log and "engine-build --tokenizer_dir <HF model dir>" in log, log
