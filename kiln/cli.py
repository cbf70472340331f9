"""`kiln`: one command for the whole pipeline (convert, build, run)."""
import json
import sys
import time

import click

from kiln.build.cli import main as build_command
from kiln.convert.cli import main as convert_command
from kiln.serve.cli import THREADS_HELP, serve as serve_command
from kiln.triton_backend.cli import triton_repo, triton_serve


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kiln-llm")
def cli():
    """Kiln: convert a Hugging Face checkpoint, compile it into an engine, generate from it, serve it."""


cli.add_command(convert_command, "convert")
cli.add_command(build_command, "build")
cli.add_command(serve_command, "serve")
cli.add_command(triton_repo, "triton-repo")
cli.add_command(triton_serve, "triton-serve")


@cli.group()
def lora():
    """LoRA adapters (engines built with engine-build --lora_plugin auto)."""


@lora.command("convert")
@click.option("--lora_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="A Hugging Face PEFT adapter dir (adapter_config.json, adapter_model.safetensors).")
@click.option("--model_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="The base model: a Kiln/TensorRT-LLM checkpoint or engine dir (its sizes check the adapter).")
@click.option("--output_dir", required=True, type=click.Path(file_okay=False),
              help="Where model.lora_weights.npy and model.lora_config.npy go (TensorRT-LLM's C++ runtime format, "
                   "what Triton's lora_weights / lora_config inputs carry).")
@click.option("--storage_type", type=click.Choice(["float16", "float32"]), default="float16", show_default=True)
def lora_convert(lora_dir, model_dir, output_dir, storage_type):
    """Convert a PEFT adapter into TensorRT-LLM's LoRA format (alpha / r folded into B)."""
    import json
    import tempfile
    from pathlib import Path

    from kiln.config import ConfigError, PretrainedConfig
    from kiln.lora.adapter import check_adapter, read_adapter, save_trtllm, to_trtllm
    from kiln.utils import replace_dir

    try:
        d = json.loads((Path(model_dir) / "config.json").read_text())
        config = PretrainedConfig.from_dict(d.get("pretrained_config", d))
        adapter = read_adapter(lora_dir, config)
        check_adapter(adapter, config, {"max_lora_rank": adapter.rank, "lora_target_modules": adapter.modules})
    except (ConfigError, OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    weights, rows = to_trtllm(adapter, storage_type)
    out = Path(output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    save_trtllm(tmp, weights, rows)
    replace_dir(tmp, out)
    click.echo(f"{len(rows[0])} LoRA rows (rank {adapter.rank}, {', '.join(adapter.modules)}) -> {out}")


@cli.command("eval-ppl")
@click.option("--engine_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="Engine dir written by engine-build.")
@click.option("--files", required=True, multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Text files to score; give the option once per file, or several paths after it.")
@click.argument("more_files", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--max_len", type=int, default=None,
              help="Window length in tokens (default and upper bound: the engine's max_input_len, and "
                   "max_seq_len - 1).")
@click.option("--threads", type=int, default=None, help=THREADS_HELP)
def eval_ppl(engine_dir, files, more_files, max_len, threads):
    """Perplexity of text files through the engine (prompt log-probabilities, in windows)."""
    from pathlib import Path

    from kiln.runtime.frontend.llm import LLM
    from kiln.runtime.frontend.perplexity import max_window, perplexity

    try:
        llm = LLM(engine_dir, threads=threads)
        limit = max_window(llm.llm_engine.build_config)
        if max_len is not None and not 2 <= max_len <= limit:
            raise ValueError(f"--max_len must be in [2, {limit}] (the engine's max_input_len, and max_seq_len - 1 "
                             f"for the token generated with each window), got {max_len}")
        texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in (*files, *more_files)]
        result = perplexity(llm, texts, max_len or limit)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{result.num_tokens} tokens in {result.num_windows} windows, mean NLL {result.nll:.4f}", err=True)
    click.echo(f"perplexity: {result.perplexity:.4f}")


@cli.command()
@click.option("--engine_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="Engine dir written by engine-build.")
@click.option("--prompt", "prompts", multiple=True, required=True,
              help="Prompt text; repeat for several prompts (generated together, printed in turn).")
@click.option("--max_tokens", type=int, default=64, show_default=True, help="Tokens to generate per prompt.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top_k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--top_p", type=float, default=1.0, show_default=True)
@click.option("--min_p", type=float, default=0.0, show_default=True)
@click.option("--repetition_penalty", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Per-request seed for reproducible sampling.")
@click.option("--stop", multiple=True, help="Stop string; repeatable.")
@click.option("--beam_width", type=int, default=1, show_default=True,
              help="Beam search of this width, printing the best beam (needs an engine built with "
                   "--max_beam_width at least this).")
@click.option("--threads", type=int, default=None, help=THREADS_HELP)
@click.option("--enable_prefix_caching/--no_enable_prefix_caching", default=True, show_default=True,
              help="Prompts that share a prefix compute it once.")
@click.option("--speculative_config", default=None,
              help='Speculative decoding, as JSON (vLLM\'s names): {"method": "eagle3"} on an engine built with an '
                   'EAGLE-3 draft, {"method": "ngram"}; num_speculative_tokens defaults to "auto".')
def run(engine_dir, prompts, threads, stop, enable_prefix_caching, beam_width, speculative_config, **sampling):
    """Generate from an engine dir, streaming each prompt's text to the terminal."""
    from kiln.runtime.frontend.llm_engine import LLMEngine
    from kiln.runtime.sampling_params import SamplingParams

    try:
        if beam_width < 1:
            raise ValueError(f"--beam_width must be >= 1, got {beam_width}")
        beam = dict(use_beam_search=True, best_of=beam_width) if beam_width > 1 else {}
        params = SamplingParams(stop=list(stop) or None, **sampling, **beam)
        spec = None if speculative_config is None else json.loads(speculative_config)
        engine = LLMEngine(engine_dir, threads=threads, enable_prefix_caching=enable_prefix_caching,
                           speculative_config=spec)
        requests = [engine.add_request(p, params) for p in prompts]
    except ValueError as e:  # ConfigError and a bad JSON too
        raise click.ClickException(str(e)) from None
    shown = {rid: 0 for rid in requests}
    current = 0
    start = time.monotonic()
    done = {}
    click.echo(prompts[0], nl=False)
    while engine.has_unfinished_requests() or current < len(requests):
        for out in engine.step():
            done[out.request_id] = out
        # Stream the current prompt's text as it grows; the others are buffered until its turn.
        while current < len(requests):
            rid = requests[current]
            out = done.get(rid)
            if out is None:
                break
            text = out.outputs[0].text
            click.echo(text[shown[rid]:], nl=False)
            sys.stdout.flush()
            shown[rid] = len(text)
            if not out.finished:
                break
            m = out.metrics
            click.echo(f"\n[{len(out.outputs[0].token_ids)} tokens, finish: {out.outputs[0].finish_reason}, "
                       f"TTFT {m.time_to_first_token * 1e3:.0f} ms"
                       + (f", {1 / m.time_per_output_token:.1f} tok/s]" if m.time_per_output_token else "]"),
                       err=True)
            current += 1
            if current < len(requests):
                click.echo(prompts[current], nl=False)
    total = sum(len(o.outputs[0].token_ids) for o in done.values())
    click.echo(f"generated {total} tokens for {len(requests)} prompt(s) in {time.monotonic() - start:.2f}s", err=True)
    stats = engine.core.stats().spec
    if stats is not None:
        rates = " ".join(f"{n / max(stats.num_drafts, 1):.2f}" for n in stats.accepted_per_pos)
        click.echo(f"speculation: {stats.num_draft_tokens} tokens drafted in {stats.num_drafts} proposals, "
                   f"{stats.num_accepted_tokens} accepted; mean acceptance length "
                   f"{1 + stats.num_accepted_tokens / max(stats.num_drafts, 1):.2f} tokens per step; accepted "
                   f"per proposal by position: {rates}", err=True)
