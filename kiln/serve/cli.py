"""`kiln serve`: the OpenAI-compatible server on uvicorn, with a graceful drain on SIGTERM.

SIGTERM (or Ctrl+C): /health turns 503, new requests get 503, requests in flight run to the end for
up to --drain_timeout seconds (then they are aborted), and the process exits 0. A second signal
stops at once.
"""
import asyncio
import contextlib
import logging
import signal
from pathlib import Path

import click
import uvicorn

from kiln.utils import expand_lists

THREADS_HELP = ("Intra-op threads (default: $OMP_NUM_THREADS, else the cores this process may use, "
                "within its CPU affinity and cgroup quota).")

log = logging.getLogger("kiln.serve")


def _both(name: str) -> tuple[str, ...]:
    """Each option in TensorRT-LLM's spelling (--max_batch_size) and vLLM's (--max-batch-size)."""
    return tuple(dict.fromkeys((f"--{name}", f"--{name.replace('_', '-')}")))


# vLLM's `serve --help` groups; each option sits in one (Kiln's own in "Kiln").
GROUPS = ("Frontend", "ModelConfig", "LoadConfig", "ParallelConfig", "CacheConfig", "SchedulerConfig", "LoRAConfig",
          "SpeculativeConfig", "ObservabilityConfig", "Kiln")
# Options that take several values after one flag, as vLLM's argparse (nargs='+') does.
LIST_OPTIONS = ("--lora-modules", "--lora_modules", "--served-model-name", "--served_model_name")


class ServeCommand(click.Command):
    """vLLM's command line: list options take several values after one flag, and --help shows the
    options in vLLM's groups."""

    def parse_args(self, ctx, args):
        return super().parse_args(ctx, expand_lists(args, LIST_OPTIONS))

    def format_options(self, ctx, formatter):
        by_group = {}
        for param in self.get_params(ctx):
            record = None if isinstance(param, click.Argument) else param.get_help_record(ctx)
            if record is not None:
                by_group.setdefault(getattr(param, "group", "Kiln"), []).append(record)
        for group in GROUPS:
            if group in by_group:
                with formatter.section(f"{group} options"):
                    formatter.write_dl(by_group[group])


def option(group: str, *names, **kwargs):
    """A click option shown under vLLM's `group` in --help."""
    def decorate(f):
        f = click.option(*names, **kwargs)(f)
        f.__click_params__[-1].group = group
        return f
    return decorate


@click.command(cls=ServeCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_tag", metavar="[MODEL]", required=False)
@option("ModelConfig", "--model", default=None,
        help="The model, as vLLM's positional MODEL: an engine dir written by engine-build, or a Hugging Face model "
             "dir (config.json, safetensors), converted and built on first use with the options below and cached "
             "under $KILN_CACHE_DIR/engines (the second start loads it).")
@option("ModelConfig", *_both("engine_dir"), type=click.Path(exists=True, file_okay=False), default=None,
        help="Kiln's name for an engine dir to serve.")
@option("Frontend", "--host", default="0.0.0.0", show_default=True, help="Where the server listens.")
@option("Frontend", "--port", type=int, default=8000, show_default=True, help="Where the server listens.")
@option("Frontend", *_both("api_key"), envvar="KILN_API_KEY", default=None,
        help="Require `Authorization: Bearer KEY` on /v1/* (env KILN_API_KEY).")
@option("ModelConfig", *_both("served_model_name"), "served_model_names", multiple=True,
        help="Model name(s) clients use (default: MODEL as given); several after one flag, or repeated.")
@option("Frontend", *_both("chat_template"), default=None,
        help="Jinja chat template (a file, or the template itself) replacing the tokenizer's.")
@option("Frontend", *_both("tool_call_parser"), type=click.Choice(["hermes", "llama3_json", "mistral"]), default=None,
        help="The format the model writes tool calls in (Hermes/Qwen2.5/Qwen3, Llama 3.x JSON, Mistral), for "
             "tool_choice auto. Named and required tool_choice need none: their calls are generated under a "
             "JSON-schema grammar built from the request's tools.")
@option("Frontend", *_both("enable_auto_tool_choice"), is_flag=True, default=False,
        help="Let the model decide whether to call a tool (tool_choice auto, the default with tools); "
             "needs --tool-call-parser.")
@option("Frontend", *_both("max_request_body_bytes"), type=int, default=16 << 20, show_default=True,
        help="Larger request bodies get 413.")
@option("Frontend", *_both("drain_timeout"), type=float, default=30.0, show_default=True,
        help="Seconds requests in flight get to finish after SIGTERM.")
@option("Frontend", *_both("disable_log_requests"), is_flag=True, default=False,
        help="Log no line per request (the access log off).")
@option("ModelConfig", *_both("dtype"), default="auto", show_default=True,
        type=click.Choice(["auto", "half", "float16", "bfloat16", "float", "float32"]),
        help="Weights' dtype: an engine's must match; a model is converted to it (auto: the checkpoint's, float32 "
             "as float16).")
@option("ModelConfig", "--quantization", "-q", default=None, type=click.Choice(["fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors", "modelopt",
                           "bitsandbytes", "smoothquant"]),
        help="Checked against a pre-quantized model's quantization_config (its quant_method; fp8: FP8 weights of any "
             "producer), or an engine's quant_algo; fp8 converts an unquantized model to FP8 (ModelOpt calibration).")
@option("ModelConfig", *_both("max_model_len"), type=int, default=None,
        help="Prompt + output tokens per request: at most the engine's max_seq_len (requests beyond it are refused); "
             "a model is built for it (default: its max_position_embeddings).")
@option("ModelConfig", *_both("enforce_eager"), is_flag=True, default=False,
        help="A model is built with the eager backend (no compiled graph); an engine runs as built.")
@option("ModelConfig", *_both("trust_remote_code"), is_flag=True, default=False,
        help="Accepted; no remote code runs in Kiln.")
@option("LoadConfig", *_both("load_format"), type=click.Choice(["auto", "safetensors"]), default="auto",
        show_default=True, help="Kiln reads safetensors only, never pickles.")
@option("ParallelConfig", "--tensor-parallel-size", "--tensor_parallel_size", "-tp", type=int, default=None,
        help="The engine's tp_size (checked), or the one a model is converted with (its ranks in worker processes).")
@option("ParallelConfig", "--pipeline-parallel-size", "--pipeline_parallel_size", "-pp", type=int, default=None,
        help="The engine's pp_size (checked), or the one a model is converted with.")
@option("CacheConfig", *_both("gpu_memory_utilization"), type=float, default=None,
        help="The share of free memory the KV cache may take (Kiln's kv_cache_free_mem_fraction).")
@option("CacheConfig", "--enable_prefix_caching/--no_enable_prefix_caching", "--enable-prefix-caching/"
        "--no-enable-prefix-caching", default=True, show_default=True,
        help="Reuse the KV blocks of prompt prefixes seen before (chat history, system prompts).")
@option("CacheConfig", *_both("prefix_cache_seed"), type=int, default=None,
        help="Key of the prefix cache's block hashes (default: random per process, so that hashes "
             "cannot be predicted across restarts).")
@option("CacheConfig", *_both("kv_cache_free_mem_fraction"), type=float, default=None,
        help="Kiln's name: fraction of free memory for the KV cache.")
@option("CacheConfig", *_both("max_tokens_in_paged_kv_cache"), type=int, default=None,
        help="TensorRT-LLM's name: KV cache size in tokens.")
@option("SchedulerConfig", *_both("max_num_seqs"), type=int, default=None,
        help="Requests in one step: the core's max_batch_size (at most the engine's; a model is built for it, "
             "default 256).")
@option("SchedulerConfig", *_both("max_num_batched_tokens"), type=int, default=None,
        help="Tokens in one step: the core's max_num_tokens (at most the engine's; a model is built for it, "
             "default 2048).")
@option("SchedulerConfig", "--enable_chunked_prefill/--disable_chunked_prefill", "--enable-chunked-prefill/"
        "--disable-chunked-prefill", default=True, show_default=True,
        help="Prefill long prompts in chunks within the step's token budget, beside running requests.")
@option("SchedulerConfig", *_both("scheduler_policy"), type=click.Choice(["max_utilization", "guaranteed_no_evict"]),
        default="max_utilization", show_default=True, help="TensorRT-LLM's capacity scheduler policies.")
@option("SchedulerConfig", *_both("max_batch_size"), type=int, default=None,
        help="TensorRT-LLM's name for --max-num-seqs.")
@option("SchedulerConfig", *_both("max_num_tokens"), type=int, default=None,
        help="TensorRT-LLM's name for --max-num-batched-tokens.")
@option("LoRAConfig", *_both("enable_lora"), is_flag=True, default=False,
        help="Serve LoRA adapters: the engine must be built with them (engine-build --lora_plugin auto); a model "
             "is built so.")
@option("LoRAConfig", *_both("lora_modules"), "lora_modules", multiple=True,
        help="LoRA adapters served as models of their own: NAME=PATH (a Hugging Face PEFT dir) or vLLM's JSON "
             '{"name": ..., "path": ...}; several after one flag, or repeated.')
@option("LoRAConfig", *_both("max_lora_rank"), type=int, default=None,
        help="At most the engine's max_lora_rank (checked).")
@option("LoRAConfig", *_both("max_loras"), type=int, default=None,
        help="Adapters in the engine at once (its adapter slots; default 4): more wait for a slot.")
@option("LoRAConfig", *_both("max_cpu_loras"), type=int, default=None,
        help="Adapters kept read in host memory (default: max_loras).")
@option("LoRAConfig", *_both("allow_runtime_lora_updating"), is_flag=True, default=False,
        help="Serve vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter.")
@option("SpeculativeConfig", *_both("speculative_config"), default=None,
        help='Speculative decoding, as JSON (vLLM\'s names): {"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_max": 4} or {"method": "draft_model", "draft_engine_dir": DIR, '
             '"num_speculative_tokens": 4}.')
@option("SpeculativeConfig", *_both("speculative_model"), default=None,
        help='vLLM\'s older form: "[ngram]" for prompt lookup, or a draft model (engine or HF dir, built alike).')
@option("SpeculativeConfig", *_both("num_speculative_tokens"), type=int, default=None,
        help="With --speculative-model: tokens drafted per step (speculative_config's num_speculative_tokens).")
@option("SpeculativeConfig", *_both("ngram_prompt_lookup_max"), type=int, default=None,
        help='With --speculative-model "[ngram]": the longest n-gram looked up (prompt_lookup_max).')
@option("SpeculativeConfig", *_both("ngram_prompt_lookup_min"), type=int, default=None,
        help='With --speculative-model "[ngram]": the shortest n-gram looked up (prompt_lookup_min).')
@option("ObservabilityConfig", *_both("metrics_names"), type=click.Choice(["both", "vllm", "kiln"]), default="both",
        show_default=True,
        help="/metrics series under vLLM's names (vllm:..., with vLLM's older gpu_cache_usage_perc and "
             "avg_*_throughput_toks_per_s), Kiln's (kiln:...), or both.")
@option("ObservabilityConfig", *_both("disable_log_stats"), is_flag=True, default=False,
        help="Accepted; Kiln logs no periodic stats (they are on /metrics).")
@option("ObservabilityConfig", *_both("log_level"), type=click.Choice(["debug", "info", "warning", "error"]),
        default="info", show_default=True, help="The server's log level.")
@option("ObservabilityConfig", "--access_log/--no_access_log", "--access-log/--no-access-log", default=True,
        show_default=True, help="uvicorn's line per HTTP request.")
@option("Kiln", "--threads", type=int, default=None, help=THREADS_HELP)
@option("Kiln", *_both("skip_tokenizer_init"), is_flag=True, default=False,
        help="Load no tokenizer (for engines built without one): prompts are token ids, completions "
             "carry token_ids and empty text.")
def serve(model_tag, model, engine_dir, host, port, api_key, served_model_names, chat_template, tool_call_parser,
          enable_auto_tool_choice, max_request_body_bytes, drain_timeout, log_level, access_log, lora_modules,
          allow_runtime_lora_updating, metrics_names, disable_log_requests, disable_log_stats, **engine_args):
    """Serve MODEL (an engine dir, or a Hugging Face model dir built on first use) with OpenAI's HTTP API
    (/v1/completions, /v1/chat/completions, /v1/models), plus /tokenize, /detokenize, /health, /version
    and Prometheus /metrics. vLLM's options are taken with their meaning on a Kiln engine (each says
    what it maps to)."""
    from prometheus_client import disable_created_metrics

    from kiln.config import ConfigError
    from kiln.serve.app import ServeConfig, ServerState, build_app
    from kiln.vllm_args import EngineArgs, resolve

    given = [m for m in (model_tag, model, engine_dir) if m is not None]
    if len(given) != 1:
        raise click.UsageError("give the model once: kiln serve MODEL (or --model / --engine_dir)")
    disable_created_metrics()  # no `_created` series beside each counter and histogram
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if chat_template is not None and Path(chat_template).is_file():
        chat_template = Path(chat_template).read_text()
    elif chat_template is not None and "{" not in chat_template:
        raise click.BadParameter(f"{chat_template!r} is neither a file nor a Jinja template",
                                 param_hint="--chat_template")
    if engine_args.get("speculative_config") is not None:
        import json

        from kiln.runtime.core.spec_decode import SpeculativeConfig
        try:
            engine_args["speculative_config"] = json.loads(engine_args["speculative_config"])
            SpeculativeConfig.from_dict(engine_args["speculative_config"])
        except (ValueError, ConfigError) as e:
            raise click.BadParameter(str(e), param_hint="--speculative_config") from None
    if enable_auto_tool_choice and tool_call_parser is None:
        raise click.BadParameter("needs --tool-call-parser (the format the model writes calls in)",
                                 param_hint="--enable-auto-tool-choice")
    if max_request_body_bytes < 1 or drain_timeout < 0:
        raise click.BadParameter("--max_request_body_bytes must be >= 1 and --drain_timeout >= 0")
    vllm = {k: engine_args.pop(k) for k in list(engine_args) if k in EngineArgs.names()}
    vllm["disable_log_stats"], vllm["disable_log_requests"] = disable_log_stats, disable_log_requests
    args = EngineArgs(model=given[0], **vllm)
    try:  # a clear error now for a dir that is not a model; the weights load once the port is open
        engine, core = resolve(args, log=log.info)
        loras = _lora_modules(lora_modules)
        if loras and not args.enable_lora and not _lora_engine(engine):
            raise ConfigError("--lora-modules needs an engine built with LoRA (engine-build --lora_plugin auto)")
    except (ConfigError, OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    for note in args.notes:
        log.info(note)
    clash = sorted(k for k in core if engine_args.get(k) is not None)
    if clash:
        raise click.UsageError(f"--{clash[0].replace('_', '-')} is set by a vLLM option too; give one of them")
    config = ServeConfig(str(engine), {**{k: v for k, v in engine_args.items() if v is not None}, **core},
                         list(served_model_names) or [given[0]], chat_template, api_key, max_request_body_bytes,
                         tool_call_parser, enable_auto_tool_choice, loras, allow_runtime_lora_updating,
                         metrics_names)
    state = ServerState(config)
    server = DrainingServer(uvicorn.Config(build_app(config, state), host=host, port=port, log_level=log_level,
                                           access_log=access_log and not disable_log_requests,
                                           timeout_graceful_shutdown=3),
                            state, drain_timeout)
    state.on_fatal = server.stop
    server.run()
    if state.load_error is not None or state.engine_error is not None:
        raise SystemExit(1)
    log.info("stopped")


def _lora_engine(engine_dir) -> bool:
    from kiln.config import EngineConfig

    return EngineConfig.load(engine_dir).build_config.lora_config is not None


def _lora_modules(specs: tuple[str, ...]) -> dict[str, str]:
    import json

    modules = {}
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                d = json.loads(spec)
                name, path = d["name"], d["path"]
            except (ValueError, KeyError, TypeError):
                raise click.BadParameter(f"{spec!r} is not JSON with name and path", param_hint="--lora-modules")
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise click.BadParameter(f"{spec!r} is not NAME=PATH", param_hint="--lora-modules")
        if name in modules:
            raise click.BadParameter(f"adapter name {name!r} given twice", param_hint="--lora-modules")
        modules[name] = path
    return modules


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with signal handling that drains the engine first and exits 0 (uvicorn's own
    re-raises the signal after its shutdown, so the process would die of it)."""

    def __init__(self, config: uvicorn.Config, state, drain_timeout: float):
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout
        self.draining: asyncio.Future | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        for sig in sigs:
            loop.add_signal_handler(sig, self.on_signal, sig)
        try:
            yield
        finally:
            for sig in sigs:
                loop.remove_signal_handler(sig)

    def on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.draining is not None:  # a second signal: stop now
            log.warning("%s again: stopping without waiting", name)
            self.force_exit = self.should_exit = True
            return
        log.info("%s: draining (%d request(s) in flight, up to %g s)", name, self.state.in_flight,
                 self.drain_timeout)
        self.draining = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        await self.state.drain(self.drain_timeout)
        self.should_exit = True

    def stop(self) -> None:  # from any thread: uvicorn polls should_exit every 0.1 s
        self.should_exit = True
