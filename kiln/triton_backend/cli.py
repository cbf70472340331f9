"""`kiln triton-repo` and `kiln triton-serve`."""
import sys

import click

from kiln.serve.cli import _both


def _parameters(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for item in values:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise click.BadParameter(f"{item!r}: expected key=value", param_hint="--param")
        out[key.strip()] = value
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(*_both("engine_dir"), type=click.Path(exists=True, file_okay=False), help="Engine dir written by "
              "engine-build (gpt_model_path, and tokenizer_dir unless given).")
@click.option(*_both("output_dir"), type=click.Path(), help="The repository to write.")
@click.option("--param", "params", multiple=True, metavar="KEY=VALUE",
              help="A parameter, by TensorRT-LLM's name (repeatable): gpt_model_type, batch_scheduler_policy, "
                   "max_tokens_in_paged_kv_cache, kv_cache_free_gpu_mem_fraction, enable_chunked_context, "
                   "enable_kv_cache_reuse, exclude_input_in_output, cancellation_check_period_ms, "
                   "stats_check_period_ms, tokenizer_dir, add_special_tokens, skip_special_tokens, "
                   "triton_max_batch_size, decoupled_mode, "
                   "max_queue_delay_microseconds, bls_instance_count, preprocessing_instance_count, "
                   "postprocessing_instance_count, ...")
@click.option("--layout", type=click.Choice(["inflight_batcher_llm", "llmapi"]), default="inflight_batcher_llm",
              show_default=True, help="inflight_batcher_llm: TensorRT-LLM's five models (token ids in and out of "
              "tensorrt_llm, text through the ensemble or BLS); llmapi: its single text-in, text-out tensorrt_llm "
              "model, configured by 1/model.yaml (the fastest for text clients).")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty --output_dir.")
@click.option("--check", "check_dir", type=click.Path(), default=None,
              help="Check an existing repository instead (ours, or one filled with fill_template.py).")
def triton_repo(engine_dir, output_dir, params, layout, overwrite, check_dir):
    """Write a Triton model repository in one of TensorRT-LLM's layouts, with its models' tensor names,
    serving the engine in-process: inflight_batcher_llm (preprocessing, tensorrt_llm, postprocessing,
    ensemble, tensorrt_llm_bls) or llmapi (one tensorrt_llm model)."""
    from kiln.triton_backend.parameters import PARAMETERS, ParamError
    from kiln.triton_backend.repository import check_repository, write_repository

    if check_dir is not None:
        problems = check_repository(check_dir)
        for p in problems:
            click.echo(f"{check_dir}: {p}", err=True)
        if problems:
            raise SystemExit(1)
        click.echo(f"{check_dir}: ok")
        return
    if engine_dir is None or output_dir is None:
        raise click.UsageError("--engine_dir and --output_dir are required (or --check REPO)")
    try:
        out = write_repository(engine_dir, output_dir, _parameters(params), overwrite, layout)
    except ParamError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {out} ({len(PARAMETERS)} parameters checked); serve it with "
               f"`kiln triton-serve --model_repo {out}`")


@click.command(context_settings={"help_option_names": ["-h", "--help"], "ignore_unknown_options": True})
@click.option(*_both("model_repo"), required=True, type=click.Path(exists=True, file_okay=False),
              help="A repository written by `kiln triton-repo`.")
@click.option("--address", default="0.0.0.0", show_default=True, help="Where HTTP, gRPC and metrics listen.")
@click.option(*_both("http_port"), type=int, default=8000, show_default=True)
@click.option(*_both("grpc_port"), type=int, default=8001, show_default=True)
@click.option(*_both("metrics_port"), type=int, default=8002, show_default=True)
@click.option(*_both("exit_timeout_secs"), type=int, default=30, show_default=True,
              help="Triton's drain on SIGTERM: seconds requests in flight get to finish.")
@click.argument("tritonserver_args", nargs=-1, type=click.UNPROCESSED)
def triton_serve(model_repo, address, http_port, grpc_port, metrics_port, exit_timeout_secs, tritonserver_args):
    """Run tritonserver on a repository (the one on PATH, else nvidia-pytriton's): wait until it is
    ready, forward SIGINT/SIGTERM, exit with its status. Arguments after `--` go to tritonserver."""
    from kiln.triton_backend.repository import check_repository
    from kiln.triton_backend.server import LaunchError, serve

    problems = check_repository(model_repo)
    if problems:
        raise click.ClickException(f"{model_repo}: " + f"\n{model_repo}: ".join(problems))
    try:
        code = serve(model_repo, address, http_port, grpc_port, metrics_port, exit_timeout_secs, tritonserver_args,
                     log=lambda m: click.echo(m, err=True))
    except LaunchError as e:
        raise click.ClickException(str(e)) from None
    sys.exit(code)
