"""Defaults that work: int4 quantization of the model we ship with no --group_size, and
`kiln eval-ppl` on an engine whose max_input_len is its max_seq_len."""
import json
import sysconfig
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import cli
from kiln.convert.cli import main as convert

DEFAULT_MODEL = Path(__file__).parents[1] / "models" / "kiln-tiny-stdlib"
TEXT = Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py"


@pytest.mark.parametrize("qformat", ["int4_wo", "int4_awq", "int4_gptq", "w4a8_awq"])
def test_int4_on_the_default_model_picks_a_group_size(qformat, tmp_path):
    calib = [] if qformat == "int4_wo" else ["--calib_dataset", str(TEXT), "--calib_size", "2",
                                             "--calib_max_seq_len", "32", "--eval_size", "1"]
    result = CliRunner().invoke(convert, ["--model_dir", str(DEFAULT_MODEL), "--output_dir", str(tmp_path / "c"),
                                          "--qformat", qformat, *calib])
    assert result.exit_code == 0, result.output
    # 704 (intermediate_size) rules out 128 and 256; 64 divides it and hidden_size 256.
    assert json.loads((tmp_path / "c" / "config.json").read_text())["quantization"]["group_size"] == 64
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("converted LlamaForCausalLM in ")
    assert (f", {qformat}, group size 64 (no --group_size: the largest supported dividing every linear's "
            f"input size) -> {tmp_path / 'c'}") in line, line


def test_an_explicit_group_size_that_does_not_divide_stays_an_error(tmp_path):
    result = CliRunner().invoke(convert, ["--model_dir", str(DEFAULT_MODEL), "--output_dir", str(tmp_path / "c"),
                                          "--qformat", "int4_wo", "--group_size", "128"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: --group_size 128 does not divide the input dimension 704 of ")
    assert not (tmp_path / "c").exists()


def test_eval_ppl_windows_fit_an_engine_with_max_input_len_equal_to_max_seq_len(engine):
    engine_dir = engine("llama", max_input_len=64, max_seq_len=64, max_num_tokens=256)
    result = CliRunner().invoke(cli, ["eval-ppl", "--engine_dir", str(engine_dir), "--files", str(TEXT)])
    assert result.exit_code == 0, result.output
    tokens, windows = (int(w) for w in result.stderr.split()[:4:3])  # "N tokens in W windows, ..."
    assert (windows - 1) * 62 < tokens <= windows * 62, "windows of 63 tokens, each predicting 62"
    assert result.stdout.startswith("perplexity: ")
    bad = CliRunner().invoke(cli, ["eval-ppl", "--engine_dir", str(engine_dir), "--files", str(TEXT),
                                   "--max_len", "64"])
    assert bad.exit_code != 0 and "--max_len must be in [2, 63]" in bad.output
