"""`kiln eval-ppl` against HF transformers' perplexity on the same files and windows."""
import math
import sysconfig
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner

from kiln import LLM
from kiln.cli import cli
from kiln.runtime.frontend.perplexity import perplexity, windows

FILES = [Path(sysconfig.get_paths()["stdlib"]) / name for name in ("json/tool.py", "colorsys.py")]
# Float32 engine against float32 HF on the same windows: the logits agree to ~1e-6 and the mean NLL
# over ~10^3-10^4 tokens averages that out; measured |ours/HF - 1| <= 1.6e-7 (tiny llama at both
# window lengths, the default model). 1e-5 leaves headroom for another CPU's summation order.
PPL_RTOL = 1e-5


def hf_perplexity(model_dir, tokenizer, texts, max_len):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for text in texts:
        for w in windows(tokenizer.encode(text, add_special_tokens=False), max_len):
            with torch.no_grad():
                logits = model(torch.tensor([w])).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum").item()
            count += len(w) - 1
    return math.exp(total / count)


def test_windows():
    assert windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a lone last token predicts nothing


@pytest.mark.parametrize("max_len", [128, 40])
def test_perplexity_matches_hf(engine, hf_model, max_len):
    llm = LLM(engine("llama"))
    texts = [f.read_text() for f in FILES]
    ours = perplexity(llm, texts, max_len)
    theirs = hf_perplexity(hf_model("llama"), llm.get_tokenizer(), texts, max_len)
    assert ours.num_windows > len(texts)  # the files really were split into windows
    assert abs(ours.perplexity / theirs - 1) < PPL_RTOL, (ours.perplexity, theirs)


def test_eval_ppl_cli(engine):
    result = CliRunner().invoke(cli, ["eval-ppl", "--engine_dir", str(engine("llama")),
                                      "--files", str(FILES[0]), str(FILES[1]), "--max_len", "64"])
    assert result.exit_code == 0, result.output
    value = float(result.stdout.strip().splitlines()[-1].removeprefix("perplexity: "))
    api = perplexity(LLM(engine("llama")), [f.read_text() for f in FILES], 64).perplexity
    assert value == pytest.approx(api, abs=5e-5)  # the CLI prints 4 decimals
    bad = CliRunner().invoke(cli, ["eval-ppl", "--engine_dir", str(engine("llama")),
                                   "--files", str(FILES[0]), "--max_len", "1000"])
    assert bad.exit_code != 0 and "max_len must be in [2, 128]" in bad.output


DEFAULT_MODEL = Path(__file__).parents[1] / "models" / "kiln-tiny-stdlib"
HELD_OUT = ["getopt.py", "operator.py"]  # held out from training (see the model card)


def test_default_model_perplexity(tmp_path):
    """The shipped model, through convert, build and eval-ppl, against HF on held-out files."""
    from kiln.build.builder import build_engine
    from kiln.config import BuildConfig
    from kiln.convert.cli import convert_checkpoint

    ckpt = convert_checkpoint(DEFAULT_MODEL, tmp_path / "c", dtype="float32")
    engine_dir = build_engine(ckpt, tmp_path / "e", BuildConfig(
        max_batch_size=8, max_input_len=256, max_seq_len=512, max_num_tokens=1024, tokens_per_block=16,
        backend="eager"), log=lambda *_: None)
    llm = LLM(engine_dir)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text() for name in HELD_OUT]
    ours = perplexity(llm, texts, 256)
    theirs = hf_perplexity(DEFAULT_MODEL, llm.get_tokenizer(), texts, 256)
    assert abs(ours.perplexity / theirs - 1) < PPL_RTOL, (ours.perplexity, theirs)
    assert ours.perplexity < 200  # trained: far from the 8192 of a uniform guess
