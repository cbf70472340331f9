"""`kiln triton-repo` and what needs no server: it refuses bad parameters before writing anything,
`--check` names the problems of a hand-filled repository, the templates hold exactly the parameters,
TensorRT-LLM's sampling table row by row, the BLS model wired as the ensemble, streamed chunks
that never split a character, and deploy/triton's manifests agree with the server they run."""
import re
import shutil
import string
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kiln import SamplingParams
from kiln.cli import cli
from kiln.runtime.frontend.detokenizer import IncrementalDetokenizer
from kiln.runtime.outputs import CompletionOutput, RequestOutput
from kiln.triton_backend import interface, repository
from kiln.triton_backend.engine_io import Row, Tracker
from kiln.triton_backend.parameters import PARAMETERS, parse
from kiln.triton_backend.sampling import SEMANTICS, markdown_table, sampling_fields
from kiln.triton_backend.text import decode

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def engine_dir(engine):
    return engine("llama", max_seq_len=1024)  # the one tests/test_triton.py serves


@pytest.fixture(scope="module")
def repo(engine_dir, tmp_path_factory):
    return repository.write_repository(engine_dir, tmp_path_factory.mktemp("repo") / "repo", {})


@pytest.fixture(scope="module")
def tok(engine_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine_dir)


def test_templates_hold_exactly_the_parameters():
    names = {m.group(1) for f in repository.TEMPLATES.rglob("config.pbtxt")
             for m in repository.PLACEHOLDER.finditer(f.read_text())}
    assert names == set(PARAMETERS)


def test_triton_repo_refuses_bad_parameters(engine_dir, tmp_path):
    out = tmp_path / "repo"
    cases = [
        (["--param", "engine_dir=/x"], "unknown parameter 'engine_dir'"),
        (["--param", "gpt_model_path="], "gpt_model_path"),
        (["--param", "triton_max_batch_size=many"], "triton_max_batch_size: expected an integer >= 1, got 'many'"),
        (["--param", "decoupled_mode=maybe"], "decoupled_mode: expected true or false"),
        (["--param", "gpt_model_type=V1"], "V1 (static batching) is not supported"),
        (["--param", "enable_kv_cache_reuse=sometimes"], "enable_kv_cache_reuse: expected true or false"),
        (["--param", "max_beam_width=2"], "max_beam_width: 2 exceeds the engine's max_beam_width (1)"),
        (["--param", "max_beam_width=0"], "max_beam_width: expected an integer >= 1"),
        (["--param", "kv_cache_free_gpu_mem_fraction=1.5"], "kv_cache_free_gpu_mem_fraction"),
        (["--param", f"tokenizer_dir={tmp_path / 'missing'}"], "tokenizer_dir"),
        (["--param", 'tokenizer_dir=/a"b'], "cannot be written"),
        (["--param", "cancellation_check_period_ms"], "expected key=value"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(cli, ["triton-repo", "--engine_dir", str(engine_dir), "--output_dir", str(out),
                                          *args])
        assert result.exit_code != 0 and message in result.output, (args, result.output)
        assert sum("Error" in line for line in result.output.splitlines()) == 1, result.output  # one line
        assert not out.exists() and list(tmp_path.iterdir()) == [], args  # nothing written, no temp dir left
    inside = engine_dir / "repo"
    result = CliRunner().invoke(cli, ["triton-repo", "--engine_dir", str(engine_dir), "--output_dir", str(inside)])
    assert result.exit_code != 0 and "overlaps gpt_model_path" in result.output and not inside.exists()


def test_check_names_every_problem_of_a_hand_filled_repository(engine_dir, tmp_path):
    """Filled as TensorRT-LLM's tools/fill_template.py does (string.Template.safe_substitute), with
    gpt_model_path forgotten and a bad value."""
    hand = tmp_path / "hand"
    shutil.copytree(repository.TEMPLATES, hand)
    subs = dict(triton_max_batch_size="8", decoupled_mode="true", max_queue_delay_microseconds="0",
                tokenizer_dir=str(engine_dir), add_special_tokens="true", skip_special_tokens="true",
                bls_instance_count="1", preprocessing_instance_count="1", postprocessing_instance_count="1",
                gpt_model_type="inflight_fused_batching", batch_scheduler_policy="max_utilization",
                max_tokens_in_paged_kv_cache="", kv_cache_free_gpu_mem_fraction="", enable_chunked_context="false",
                enable_kv_cache_reuse="false", exclude_input_in_output="false", max_beam_width="1",
                cancellation_check_period_ms="100", stats_check_period_ms="often", decoding_mode="top_k_top_p")
    for f in hand.rglob("config.pbtxt"):
        f.write_text(string.Template(f.read_text()).safe_substitute(subs))
    result = CliRunner().invoke(cli, ["triton-repo", "--check", str(hand)])
    assert result.exit_code == 1
    assert re.search(r"tensorrt_llm/config.pbtxt:\d+: \$\{gpt_model_path\} was never filled in", result.output)
    subs["gpt_model_path"] = str(engine_dir)
    for f in hand.rglob("config.pbtxt"):
        f.write_text(string.Template(f.read_text()).safe_substitute(subs))
    result = CliRunner().invoke(cli, ["triton-repo", "--check", str(hand)])
    assert result.exit_code == 1 and "stats_check_period_ms: expected an integer >= 1, got 'often'" in result.output
    text = (hand / "tensorrt_llm" / "config.pbtxt").read_text().replace('"often"', '"100"')
    (hand / "tensorrt_llm" / "config.pbtxt").write_text(text)
    result = CliRunner().invoke(cli, ["triton-repo", "--check", str(hand)])
    assert result.exit_code == 0, result.output


def test_sampling_semantics_table():
    """TensorRT-LLM's rules, row by row, on SamplingParams; README shows the same table."""
    assert markdown_table() in (ROOT / "README.md").read_text()
    for rule in SEMANTICS:
        if rule.expect is None:
            with pytest.raises(ValueError, match="top_p"):
                sampling_fields(**rule.example)
            continue
        params = SamplingParams(**sampling_fields(**rule.example))
        assert {k: getattr(params, k) for k in rule.expect} == pytest.approx(rule.expect), rule
        assert params.greedy == (rule.expect["temperature"] == 0), rule
    for bad in (dict(top_k=-1), dict(temperature=-0.5), dict(top_p=-0.1)):
        with pytest.raises(ValueError):
            sampling_fields(**bad)


def test_streamed_chunks_never_split_a_character(tok):
    """What tensorrt_llm streams and postprocessing decodes, for output tokens whose characters span
    several tokens (the byte-level tokenizer has no token for most non-ASCII characters): every chunk
    is whole characters, and the chunks join into the full decode."""
    prompt = tok.encode("say:")
    tokens = tok.encode(" naïve café — 🙂 ok, 日本")
    assert len(tokens) > len(" naïve café — 🙂 ok, 日本".encode()) // 2  # mostly byte tokens
    row = Row(prompt, SamplingParams(), streaming=True, exclude_input=False, end_id=None, pad_id=0, log_probs=False,
              perf_metrics=False)
    tracker, d, chunks = Tracker(row, 0, 8), IncrementalDetokenizer(tok, prompt), []
    for i, t in enumerate(tokens):
        d.add(t)
        last = i == len(tokens) - 1
        text = d.text + (d.flush() if last else "")
        c = CompletionOutput(0, text, tokens[:i + 1], None, None, "length" if last else None)
        for r in tracker.update(RequestOutput("r", None, prompt, None, [c], last)):
            chunks.append(decode(tok, r["output_ids"][0, 0].tolist(), r["prefix_ids"][0, 0].tolist(), True))
    assert "".join(chunks) == tok.decode(tokens) == " naïve café — 🙂 ok, 日本"
    assert all("\ufffd" not in c for c in chunks) and 1 < len(chunks) < len(tokens)


def test_bls_maps_inputs_as_the_ensemble_does(repo):
    config = repository._parse_config((repo / "ensemble" / "config.pbtxt").read_text())
    pre, engine, post = config.ensemble_scheduling.step
    assert dict(pre.input_map) == {v: k for k, v in interface.TO_PREPROCESSING.items()}
    assert {k: v for k, v in engine.input_map.items() if not v.startswith("_")} == \
        {v: k for k, v in interface.TO_ENGINE.items()}
    assert dict(post.input_map).keys() == set(interface.TO_POSTPROCESSING.values())
    assert {k for k in engine.output_map if k not in interface.TO_POSTPROCESSING} == set(interface.PASSED_THROUGH)


# ----------------------------------------------------------------------------- deploy/triton
@pytest.fixture(scope="module")
def manifests() -> dict:
    docs = [d for f in sorted((ROOT / "deploy" / "triton").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())
            if d and d.get("kind")]
    return {d["kind"]: d for d in docs}


def flags(command: list[str]) -> dict[str, list[str]]:
    out = {}
    for arg in command:
        if arg.startswith("--"):
            key, _, value = arg[2:].partition("=")
            out.setdefault(key.replace("-", "_"), []).append(value)
    return out


def test_triton_deployment_writes_a_valid_repository_and_serves_it(manifests):
    pod = manifests["Deployment"]["spec"]["template"]
    (init,) = pod["spec"]["initContainers"]
    (server,) = pod["spec"]["containers"]
    assert init["command"][:2] == ["kiln", "triton-repo"] and server["command"][0] == "tritonserver"
    repo_args, server_args = flags(init["command"]), flags(server["command"])
    for item in repo_args["param"]:
        key, _, value = item.partition("=")
        assert key in PARAMETERS and PARAMETERS[key].kind != "path", key
        parse(key, value)  # the values the init container passes are good ones
    assert repo_args["output_dir"] == server_args["model_repository"]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert repo_args["engine_dir"][0].startswith(mounts["engines"] + "/")
    assert server_args["model_repository"][0].startswith(mounts["models"] + "/")
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert {k: int(server_args[f"{k}_port"][0]) for k in ("http", "grpc", "metrics")} == ports
    for probe, path in (("startupProbe", "/v2/health/ready"), ("readinessProbe", "/v2/health/ready"),
                        ("livenessProbe", "/v2/health/live")):
        assert server[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
    assert int(ann["prometheus.io/port"]) == ports["metrics"]


def test_triton_grace_period_covers_the_drain(manifests):
    pod = manifests["Deployment"]["spec"]["template"]
    (server,) = pod["spec"]["containers"]
    drain = int(flags(server["command"])["exit_timeout_secs"][0])
    pre_stop = server["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["spec"]["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + drain + 5
    live, ready = server["livenessProbe"], server["readinessProbe"]
    # draining, Triton takes no new connection (tests/test_triton.py's SIGTERM test): the liveness
    # probe must outlast the drain, or the kubelet kills the pod in the middle of it
    assert live["periodSeconds"] * live["failureThreshold"] >= drain
    assert ready["periodSeconds"] * ready["failureThreshold"] <= float(pre_stop[1])
    svc = manifests["Service"]["spec"]
    assert svc["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in svc["ports"]} == {p["name"] for p in server["ports"]}
    dockerfile = (ROOT / "deploy" / "triton" / "Dockerfile").read_text()
    assert "FROM nvcr.io/nvidia/tritonserver:" in dockerfile and "'.[triton]'" in dockerfile


def test_a_stub_that_cannot_start_its_interpreter_is_named_in_one_line():
    """kiln triton-serve relays tritonserver's output and says what an interpreter mismatch (a
    virtualenv's stdlib in the system's libpython) is and what to do, once."""
    import io

    from kiln.triton_backend.server import relay_output

    error = ("I1202 pb_stub.cc:366]  Failed to initialize Python stub: ImportError: /root/.pyenv/versions/3.11.7/lib/"
             "python3.11/lib-dynload/_ssl.cpython-311-x86_64-linux-gnu.so: undefined symbol: _PyModule_Add\n")
    said = []
    relay_output(io.StringIO("starting\n" + error * 3), {"PATH": "/usr/bin"}, said.append)
    assert len(said) == 1 and "could not start its interpreter" in said[0] and "/usr/bin/python3" in said[0]


def test_decoding_mode_eagle_turns_eagle3_on(engine_dir):
    """TensorRT-LLM's decoding_mode, in Kiln's repository and in a config written for its backend: eagle
    speculates with the engine's EAGLE-3 draft; modes Kiln lacks fail the load, naming what it takes."""
    from kiln.triton_backend import upstream
    from kiln.triton_backend.parameters import ParamError

    assert parse("decoding_mode", "eagle") == "eagle" and parse("decoding_mode", "top_k_top_p") == "top_k_top_p"
    values, _ = upstream.read_parameters({"gpt_model_path": {"string_value": str(engine_dir)},
                                          "decoding_mode": {"string_value": "eagle"}}, ["gpt_model_path", "decoding_mode"])
    assert values["decoding_mode"] == "eagle"
    with pytest.raises(ParamError, match="decoding_mode: expected auto or .* or eagle, got .medusa."):
        upstream.read_parameters({"gpt_model_path": {"string_value": str(engine_dir)},
                                  "decoding_mode": {"string_value": "medusa"}}, ["gpt_model_path", "decoding_mode"])
    with pytest.raises(ParamError, match="eagle_choices"):
        upstream.read_parameters({"gpt_model_path": {"string_value": str(engine_dir)},
                                  "eagle_choices": {"string_value": "[[0]]"}}, ["gpt_model_path"])
