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

THREADS_HELP = ("Intra-op threads (default: $OMP_NUM_THREADS, else the cores this process may use, "
                "within its CPU affinity and cgroup quota).")

log = logging.getLogger("kiln.serve")


def _both(name: str) -> tuple[str, str]:
    """Each option in TensorRT-LLM's spelling (--max_batch_size) and vLLM's (--max-batch-size)."""
    return f"--{name}", f"--{name.replace('_', '-')}"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(*_both("engine_dir"), required=True, type=click.Path(exists=True, file_okay=False),
              help="Engine dir written by engine-build.")
@click.option("--host", default="0.0.0.0", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option(*_both("api_key"), envvar="KILN_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` on /v1/* (env KILN_API_KEY).")
@click.option(*_both("served_model_name"), "served_model_names", multiple=True,
              help="Model name(s) clients use (default: the engine dir as given); repeatable.")
@click.option(*_both("chat_template"), default=None,
              help="Jinja chat template (a file, or the template itself) replacing the tokenizer's.")
@click.option(*_both("tool_call_parser"), type=click.Choice(["hermes", "llama3_json", "mistral"]), default=None,
              help="The format the model writes tool calls in (Hermes/Qwen2.5/Qwen3, Llama 3.x JSON, Mistral): "
                   "chat requests with `tools` get OpenAI's tool_calls parsed out of it, and `required` or a named "
                   "tool_choice are enforced by a grammar.")
@click.option(*_both("enable_auto_tool_choice"), is_flag=True, default=False,
              help="Let the model decide whether to call a tool (tool_choice auto, the default with tools); "
                   "needs --tool-call-parser.")
@click.option(*_both("max_request_body_bytes"), type=int, default=16 << 20, show_default=True,
              help="Larger request bodies get 413.")
@click.option(*_both("drain_timeout"), type=float, default=30.0, show_default=True,
              help="Seconds requests in flight get to finish after SIGTERM.")
@click.option(*_both("scheduler_policy"), type=click.Choice(["max_utilization", "guaranteed_no_evict"]),
              default="max_utilization", show_default=True)
@click.option("--enable_chunked_prefill/--disable_chunked_prefill", "--enable-chunked-prefill/"
              "--disable-chunked-prefill", default=True, show_default=True)
@click.option("--enable_prefix_caching/--no_enable_prefix_caching", "--enable-prefix-caching/"
              "--no-enable-prefix-caching", default=True, show_default=True,
              help="Reuse the KV blocks of prompt prefixes seen before (chat history, system prompts).")
@click.option(*_both("speculative_config"), default=None,
              help='Speculative decoding, as JSON (vLLM\'s names): {"method": "ngram", "num_speculative_tokens": 4, '
                   '"prompt_lookup_max": 4} or {"method": "draft_model", "draft_engine_dir": DIR, '
                   '"num_speculative_tokens": 4}.')
@click.option(*_both("prefix_cache_seed"), type=int, default=None,
              help="Key of the prefix cache's block hashes (default: random per process, so that hashes "
                   "cannot be predicted across restarts).")
@click.option(*_both("max_batch_size"), type=int, default=None, help="At most the engine's build limit.")
@click.option(*_both("max_num_tokens"), type=int, default=None, help="Tokens per step; at most the build limit.")
@click.option(*_both("kv_cache_free_mem_fraction"), type=float, default=None,
              help="Fraction of free memory for the KV cache.")
@click.option(*_both("max_tokens_in_paged_kv_cache"), type=int, default=None, help="KV cache size in tokens.")
@click.option(*_both("lora_modules"), "lora_modules", multiple=True,
              help="LoRA adapters served as models of their own: NAME=PATH (a Hugging Face PEFT dir) or vLLM's JSON "
                   '{"name": ..., "path": ...}; repeatable. Needs an engine built with --lora_plugin auto.')
@click.option(*_both("max_loras"), type=int, default=None,
              help="Adapters in the engine at once (its adapter slots; default 4): more wait for a slot.")
@click.option(*_both("max_cpu_loras"), type=int, default=None,
              help="Adapters kept read in host memory (default: max_loras).")
@click.option(*_both("allow_runtime_lora_updating"), is_flag=True, default=False,
              help="Serve vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter.")
@click.option("--threads", type=int, default=None, help=THREADS_HELP)
@click.option(*_both("skip_tokenizer_init"), is_flag=True, default=False,
              help="Load no tokenizer (for engines built without one): prompts are token ids, completions "
                   "carry token_ids and empty text.")
@click.option(*_both("log_level"), type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@click.option("--access_log/--no_access_log", "--access-log/--no-access-log", default=True, show_default=True)
def serve(engine_dir, host, port, api_key, served_model_names, chat_template, tool_call_parser, enable_auto_tool_choice,
          max_request_body_bytes, drain_timeout, log_level, access_log, lora_modules, allow_runtime_lora_updating,
          **engine_args):
    """Serve an engine with OpenAI's HTTP API (/v1/completions, /v1/chat/completions, /v1/models),
    plus /tokenize, /detokenize, /health, /version and Prometheus /metrics."""
    from prometheus_client import disable_created_metrics

    from kiln.config import ConfigError, EngineConfig
    from kiln.serve.app import ServeConfig, ServerState, build_app

    try:  # a clear error now for a dir that is not an engine; the weights load once the port is open
        EngineConfig.load(engine_dir)
    except (ConfigError, OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None

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
    config = ServeConfig(engine_dir, {k: v for k, v in engine_args.items() if v is not None},
                         served_model_names, chat_template, api_key, max_request_body_bytes, tool_call_parser,
                         enable_auto_tool_choice, _lora_modules(lora_modules), allow_runtime_lora_updating)
    state = ServerState(config)
    server = DrainingServer(uvicorn.Config(build_app(config, state), host=host, port=port, log_level=log_level,
                                           access_log=access_log, timeout_graceful_shutdown=3),
                            state, drain_timeout)
    state.on_fatal = server.stop
    server.run()
    if state.load_error is not None or state.engine_error is not None:
        raise SystemExit(1)
    log.info("stopped")


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
