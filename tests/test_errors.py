"""Bad input to engine-build, the runtime and `kiln run`: a clear one-line error, a non-zero exit from
the CLIs, and nothing half-written (no output dir, no `.e.*` temp dirs, an old engine left intact).

convert_checkpoint's own bad inputs are covered by test_convert.py.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from kiln.build.builder import build_engine
from kiln.build.cli import main as build_main
from kiln.cli import cli as kiln_main
from kiln.config import BuildConfig, ConfigError
from kiln.runtime.frontend.llm import LLM
from kiln.runtime.sampling_params import SamplingParams

BIN = Path(sys.executable).parent
ENGINE_BUILD = str(BIN / "engine-build")
KILN = str(BIN / "kiln")
# Build options matching conftest.TEST_BUILD: max_input_len 128, max_seq_len 192, max_batch_size 8.
BUILD_ARGS = ["--backend", "eager", "--max_batch_size", "8", "--max_input_len", "128", "--max_seq_len", "192",
              "--max_num_tokens", "256", "--tokens_per_block", "8"]
EAGER = BuildConfig(max_batch_size=8, max_input_len=128, max_seq_len=192, max_num_tokens=256,
                    tokens_per_block=8, backend="eager")
VOCAB = 384  # tests/tiny_models.py
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


# -- helpers -----------------------------------------------------------------------------------


def error_line(output: str) -> str:
    """The single `Error:`/`error:` line of a CLI's output; its message must not spill onto more lines."""
    lines = output.strip().splitlines()
    hits = [i for i, line in enumerate(lines) if line.lower().startswith("error:")]
    assert len(hits) == 1, f"expected one error line, got:\n{output}"
    assert hits[0] == len(lines) - 1, f"the error message runs past one line:\n{output}"
    assert "Traceback" not in output, output
    return lines[hits[0]]


def assert_one_line(message: str, *fragments: str) -> None:
    assert "\n" not in message.strip(), f"multi-line error: {message!r}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def assert_nothing_written(out: Path) -> None:
    assert not out.exists(), f"a failed build left {out}"
    if not out.parent.exists():  # failed before it created the parent
        return
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert not leftovers, f"a failed build left temp dirs {leftovers}"


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def edit_json(path: Path, edit) -> None:
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def run_cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


# -- corrupted checkpoints -----------------------------------------------------------------------


def _missing_rank(c: Path) -> None:
    (c / "rank0.safetensors").unlink()


def _truncated(c: Path) -> None:
    p = c / "rank0.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _missing_tensor(c: Path) -> None:
    p = c / "rank0.safetensors"
    weights = load_file(p)
    del weights["transformer.layers.1.mlp.gate.weight"]
    save_file(weights, p)


def _wrong_shape(c: Path) -> None:
    p = c / "rank0.safetensors"
    weights = load_file(p)
    weights["transformer.layers.0.attention.dense.weight"] = weights[
        "transformer.layers.0.attention.dense.weight"][:, :32].contiguous()
    save_file(weights, p)


def _bad_architecture(c: Path) -> None:
    edit_json(c / "config.json", lambda d: d.update(architecture="GPT2LMHeadModel"))


def _not_json(c: Path) -> None:
    (c / "config.json").write_text('{"architecture": "LlamaForCausalLM",\n')


CORRUPTIONS = {
    "missing_rank_file": (_missing_rank, ["rank0.safetensors not found", "one file per rank"]),
    "truncated": (_truncated, ["rank0.safetensors is not a readable safetensors file"]),
    "missing_tensor": (_missing_tensor, ["rank0.safetensors: missing tensor transformer.layers.1.mlp.gate.weight"]),
    "wrong_shape": (_wrong_shape, ["rank0.safetensors: tensor transformer.layers.0.attention.dense.weight",
                                   "has shape (64, 32), expected (64, 64)"]),
    "bad_architecture": (_bad_architecture, ["config.json", "architecture 'GPT2LMHeadModel' is not supported",
                                             "LlamaForCausalLM"]),
    "not_json": (_not_json, ["config.json is not valid JSON"]),
}


@pytest.fixture
def bad_checkpoint(checkpoint, tmp_path):
    def make(kind: str) -> Path:
        c = shutil.copytree(checkpoint("llama"), tmp_path / f"ckpt_{kind}")
        CORRUPTIONS[kind][0](c)
        return c

    return make


@pytest.fixture(scope="module")
def tp2_checkpoint(hf_model, tmp_path_factory):
    from kiln.convert.cli import convert_checkpoint

    return convert_checkpoint(hf_model("llama"), tmp_path_factory.mktemp("ckpt_tp2") / "c", dtype="float32",
                              tp_size=2)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_build_bad_checkpoint(kind, bad_checkpoint, tmp_path):
    ckpt, fragments = bad_checkpoint(kind), CORRUPTIONS[kind][1]
    out = tmp_path / "out" / "e"

    with pytest.raises(ConfigError) as e:
        build_engine(ckpt, out, EAGER, log=lambda *_: None)
    assert_one_line(str(e.value), *fragments)
    assert_nothing_written(out)

    result = CliRunner().invoke(build_main, ["--checkpoint_dir", str(ckpt), "--output_dir", str(out), *BUILD_ARGS])
    assert result.exit_code != 0
    assert_one_line(error_line(result.output), "Error:", *fragments)
    assert_nothing_written(out)


@pytest.mark.parametrize("kind", ["truncated"])
def test_engine_build_script_bad_checkpoint(kind, bad_checkpoint, tmp_path):
    """The installed console script, not just the click command."""
    ckpt = bad_checkpoint(kind)
    out = tmp_path / "e"
    proc = run_cli([ENGINE_BUILD, "--checkpoint_dir", str(ckpt), "--output_dir", str(out), *BUILD_ARGS])
    assert proc.returncode != 0
    assert_one_line(error_line(proc.stderr), "Error:", *CORRUPTIONS[kind][1])
    assert_nothing_written(out)


def test_build_multi_rank_checkpoint_with_a_bad_rank(tp2_checkpoint, tmp_path):
    """Each rank builds from its own file; a bad one fails the build with that rank's message,
    in this process and from a parallel build process (--workers 2), and nothing is written."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tp2_checkpoint, ckpt)
    data = (ckpt / "rank1.safetensors").read_bytes()
    (ckpt / "rank1.safetensors").write_bytes(data[: len(data) // 2])
    out = tmp_path / "e"
    with pytest.raises(ConfigError) as e:
        build_engine(ckpt, out, EAGER, log=lambda *_: None)
    assert_one_line(str(e.value), "rank1.safetensors is not a readable safetensors file")
    assert_nothing_written(out)

    result = CliRunner().invoke(build_main, ["--checkpoint_dir", str(ckpt), "--output_dir", str(out), "--workers", "2",
                                             *BUILD_ARGS])
    assert result.exit_code != 0
    assert_one_line(error_line(result.output), "Error: rank 1:", "rank1.safetensors is not a readable safetensors file")
    assert_nothing_written(out)


@pytest.mark.parametrize("args, fragments", [
    (["--max_input_len", "300", "--max_seq_len", "200"],
     ["max_input_len (300) must not exceed max_seq_len (200)"]),
    (["--max_batch_size", "16", "--max_num_tokens", "8"],
     ["max_num_tokens (8) must be >= max_batch_size (16)"]),
    (["--tokens_per_block", "0"], ["tokens_per_block must be >= 1, got 0"]),
    (["--backend", "tensorrt"], ["--backend", "'tensorrt' is not one of", "aoti", "eager"]),
])
def test_build_invalid_options(args, fragments, checkpoint, tmp_path):
    out = tmp_path / "e"
    # Later options win: these override BUILD_ARGS.
    result = CliRunner().invoke(build_main, ["--checkpoint_dir", str(checkpoint("llama")), "--output_dir", str(out),
                                             *BUILD_ARGS, *args])
    assert result.exit_code != 0
    assert_one_line(error_line(result.output), "Error:", *fragments)
    assert_nothing_written(out)


@pytest.mark.parametrize("kwargs, fragments", [
    (dict(max_input_len=300, max_seq_len=200), ["max_input_len (300)", "max_seq_len (200)"]),
    (dict(max_batch_size=16, max_num_tokens=8), ["max_num_tokens (8)", "max_batch_size (16)"]),
    (dict(backend="tensorrt"), ["backend 'tensorrt' is not supported", "aoti, eager"]),
])
def test_build_config_invalid(kwargs, fragments):
    with pytest.raises(ConfigError) as e:
        BuildConfig(**kwargs)
    assert_one_line(str(e.value), *fragments)


def test_engine_build_script_invalid_backend(checkpoint, tmp_path):
    out = tmp_path / "e"
    proc = run_cli([ENGINE_BUILD, "--checkpoint_dir", str(checkpoint("llama")), "--output_dir", str(out),
                    "--backend", "nope"])
    assert proc.returncode == 2  # click's usage error
    assert_one_line(error_line(proc.stderr), "Error:", "--backend", "'nope'")
    assert_nothing_written(out)


# -- replacing an existing output dir ------------------------------------------------------------


def test_failed_rebuild_keeps_old_engine(engine, bad_checkpoint, tmp_path):
    out = shutil.copytree(engine("llama"), tmp_path / "e")
    before = snapshot(out)
    ckpt = bad_checkpoint("wrong_shape")

    with pytest.raises(ConfigError, match="has shape"):
        build_engine(ckpt, out, EAGER, log=lambda *_: None)
    result = CliRunner().invoke(build_main, ["--checkpoint_dir", str(ckpt), "--output_dir", str(out), *BUILD_ARGS])
    assert result.exit_code != 0
    assert_one_line(error_line(result.output), "Error:", "has shape")

    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_wrong_shape", "e"]  # no .e.* temp/old dirs


def test_rebuild_replaces_engine(engine, checkpoint, tmp_path):
    """The guard below does not stop a rebuild over an engine dir."""
    out = shutil.copytree(engine("llama"), tmp_path / "e")
    (out / "stale.txt").write_text("from the old engine")
    build_engine(checkpoint("llama"), out, EAGER, log=lambda *_: None)
    assert not (out / "stale.txt").exists() and (out / "rank0.engine").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


def test_build_refuses_to_replace_a_non_engine_dir(checkpoint, tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("keep me")
    result = CliRunner().invoke(build_main, ["--checkpoint_dir", str(checkpoint("llama")), "--output_dir", str(out),
                                             *BUILD_ARGS])
    assert result.exit_code != 0
    assert_one_line(error_line(result.output), "Error:", str(out), "is not an engine dir")
    assert (out / "todo.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]


@pytest.mark.parametrize("where", ["same", "parent"])
def test_build_refuses_to_replace_the_checkpoint(where, checkpoint, tmp_path):
    ckpt = shutil.copytree(checkpoint("llama"), tmp_path / "work" / "ckpt")
    out = ckpt if where == "same" else ckpt.parent
    before = snapshot(ckpt)
    with pytest.raises(ConfigError) as e:
        build_engine(ckpt, out, EAGER, log=lambda *_: None)
    assert_one_line(str(e.value), "would replace the checkpoint dir")
    assert snapshot(ckpt) == before


# -- the runtime -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(engine):
    llm = LLM(engine("llama"))
    llm.reference = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)[0].outputs[0].token_ids
    return llm


def assert_still_serves(llm: LLM) -> None:
    """Nothing of a rejected request is left behind, and the same LLM still answers correctly."""
    engine, core = llm.llm_engine, llm.llm_engine.core
    assert not engine.has_unfinished_requests() and not core.requests
    assert not core.scheduler.waiting and not core.scheduler.running
    assert core.kv.pool.num_free == core.kv.pool.num_blocks
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)[0]
    assert out.finished and out.outputs[0].token_ids == llm.reference


@pytest.mark.parametrize("prompt, params, fragments", [
    ({"prompt_token_ids": [5] * 129}, GREEDY, ["prompt has 129 tokens", "max_input_len (128)"]),
    ("hello " * 200, GREEDY, ["more than the engine's max_input_len (128)"]),
    ({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=93),
     ["max_tokens (93) + prompt (100 tokens)", "max_seq_len (192)"]),
    ({"prompt_token_ids": [5, VOCAB]}, GREEDY, [f"prompt token id {VOCAB} is outside the vocabulary [0, {VOCAB})"]),
    ({"prompt_token_ids": [-1, 5]}, GREEDY, ["prompt token id -1 is outside the vocabulary"]),
    ({"prompt_token_ids": [5, "6"]}, GREEDY, ["prompt_token_ids must be a list of ints"]),
    ({"prompt_token_ids": [5]}, SamplingParams(n=9), ["n (9) exceeds max_batch_size (8)"]),
    ([42], GREEDY, ["a prompt must be a string or a dict", "got int"]),
])
def test_rejected_request(llm, prompt, params, fragments):
    with pytest.raises(ValueError) as e:
        llm.generate(prompt, params)
    assert_one_line(str(e.value), *fragments)
    assert_still_serves(llm)


def test_limits_are_inclusive(llm):
    """The largest accepted requests: a max_input_len prompt, and prompt + max_tokens == max_seq_len."""
    engine = llm.llm_engine
    for prompt, params in [([5] * 128, SamplingParams(max_tokens=64)), ([5] * 100, SamplingParams(max_tokens=92)),
                           ([5] * 100, SamplingParams(max_tokens=None))]:  # None: up to max_seq_len
        rid = engine.add_request({"prompt_token_ids": prompt}, params)
        assert engine.core.requests[rid].max_tokens == 192 - len(prompt)
        engine.abort(rid)
    assert_still_serves(llm)


def test_rejected_request_in_a_batch_aborts_the_batch(llm):
    """generate() validates every prompt before running any: the good ones are aborted, not left queued."""
    with pytest.raises(ValueError, match="max_input_len"):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5] * 200}], GREEDY)
    assert_still_serves(llm)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
    (dict(temperature="hot"), "temperature"),
    (dict(max_tokens=1.5), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_k=0.5), "top_k"),
    (dict(stop=5), "stop"),
    (dict(seed="1"), "seed"),
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    message = str(e.value)
    assert message.startswith(f"{field} must be"), message
    assert_one_line(message, repr(next(iter(kwargs.values()))).strip("'"))


@pytest.mark.parametrize("version", ["0.0.1", "9.0.0"])
def test_engine_from_another_kiln_version(version, engine, tmp_path):
    e = shutil.copytree(engine("llama"), tmp_path / "e")
    edit_json(e / "config.json", lambda d: d["build_config"].update(kiln_version=version))
    with pytest.raises(ConfigError) as err:
        LLM(e)
    assert_one_line(str(err.value), f"built by kiln {version}", "rebuild it with `engine-build`")


def test_engine_dir_missing_rank_engine(engine, tmp_path):
    e = shutil.copytree(engine("llama"), tmp_path / "e")
    (e / "rank0.engine").unlink()
    with pytest.raises(ConfigError) as err:
        LLM(e)
    assert_one_line(str(err.value), "rank0.engine not found", "rebuild")


def test_engine_dir_truncated_rank_engine(engine, tmp_path):
    e = shutil.copytree(engine("llama"), tmp_path / "e")
    data = (e / "rank0.engine").read_bytes()
    (e / "rank0.engine").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError) as err:
        LLM(e)
    assert_one_line(str(err.value), "rank0.engine is not a loadable eager engine", "rebuild")


def test_engine_dir_bad_config(engine, tmp_path):
    e = shutil.copytree(engine("llama"), tmp_path / "e")
    (e / "config.json").write_text(json.dumps({"pretrained_config": {}}))
    with pytest.raises(ConfigError) as err:
        LLM(e)
    assert_one_line(str(err.value), "config.json is not an engine config")
    edit_json(e / "config.json", lambda d: d.update(build_config={"kiln_version": "0.1.0"}))  # keys only
    with pytest.raises(ConfigError) as err:
        LLM(e)
    assert_one_line(str(err.value), "config.json", "missing field(s)")


# -- kiln run ----------------------------------------------------------------------------------


def test_kiln_run_prompt_too_long(engine):
    proc = run_cli([KILN, "run", "--engine_dir", str(engine("llama")), "--prompt", "hello " * 200,
                    "--max_tokens", "2", "--threads", "1"])
    assert proc.returncode != 0
    assert_one_line(error_line(proc.stderr), "Error:", "prompt has", "max_input_len (128)")
    assert proc.stdout == ""


@pytest.mark.parametrize("edit, args, fragments", [
    (None, ["--max_tokens", "500"], ["max_tokens (500)", "max_seq_len (192)"]),
    (None, ["--temperature", "-1"], ["temperature must be >= 0"]),
    (None, ["--beam_width", "2"], ["beam width 2 exceeds the engine's max_beam_width (1)", "--max_beam_width 2"]),
    (None, ["--beam_width", "0"], ["--beam_width must be >= 1"]),
    ("old_version", [], ["built by kiln 0.0.1", "rebuild"]),
    ("no_rank", [], ["rank0.engine not found"]),
])
def test_kiln_run_errors(edit, args, fragments, engine, tmp_path):
    e = engine("llama")
    if edit:
        e = shutil.copytree(e, tmp_path / "e")
        if edit == "old_version":
            edit_json(e / "config.json", lambda d: d["build_config"].update(kiln_version="0.0.1"))
        else:
            (e / "rank0.engine").unlink()
    result = CliRunner().invoke(kiln_main, ["run", "--engine_dir", str(e), "--prompt", "hi", *args])
    assert result.exit_code != 0
    assert_one_line(error_line(result.output), "Error:", *fragments)
