"""`kiln.LLM` and `kiln.AsyncLLM` as vLLM's and TensorRT-LLM's LLM APIs take them: the first argument
`model` (an engine dir, or a Hugging Face model dir built on first use and cached), vLLM's keywords
with their meaning (kiln/vllm_args.py) beside Kiln's own, and an unknown keyword a TypeError naming it
and the accepted ones. The runtime's classes underneath take an engine dir."""
import sys

from kiln.runtime.frontend.async_llm import AsyncLLM as _AsyncLLM
from kiln.runtime.frontend.llm import LLM as _LLM
from kiln.vllm_args import EngineArgs, resolve

# Kiln's own keywords: the frontend's and the engine core's.
KILN_KEYWORDS = ("engine_core", "tokenizer", "skip_tokenizer_init", "scheduler_policy", "kv_cache_free_mem_fraction",
                 "max_tokens_in_paged_kv_cache", "threads", "prefix_cache_seed", "max_batch_size", "max_num_tokens")


def engine_arguments(api: str, model, engine_dir, kwargs: dict, extra=()) -> tuple:
    """(engine dir, the runtime class's keyword arguments) for `api`'s arguments."""
    if model is not None and engine_dir is not None:
        raise TypeError(f"{api}() got both model and engine_dir; pass one")
    if model is None and engine_dir is None:
        raise TypeError(f"{api}() missing 1 required argument: 'model' (an engine dir, or a Hugging Face model dir)")
    ours = (*KILN_KEYWORDS, *extra)
    vllm = {k: kwargs.pop(k) for k in list(kwargs) if k in EngineArgs.names() and k != "model"}
    for name in kwargs:
        if name not in ours:
            raise TypeError(f"{api}() got an unexpected keyword argument {name!r}; it takes vLLM's "
                            f"{', '.join(n for n in EngineArgs.names() if n != 'model')} and Kiln's {', '.join(ours)}")
    args = EngineArgs(model=str(model if model is not None else engine_dir), **vllm)
    engine, core = resolve(args, log=lambda line: print(line, file=sys.stderr))
    for note in args.notes:
        print(note, file=sys.stderr)
    both = sorted(set(core) & set(kwargs))
    if both:
        raise TypeError(f"{api}() got {both[0]!r} twice (a vLLM option sets it too)")
    return engine, {**kwargs, **core}


class LLM(_LLM):
    def __init__(self, model=None, *, engine_dir=None, **kwargs):
        engine, kwargs = engine_arguments("LLM", model, engine_dir, kwargs)
        super().__init__(engine, **kwargs)


class AsyncLLM(_AsyncLLM):
    def __init__(self, model=None, *, engine_dir=None, **kwargs):
        engine, kwargs = engine_arguments("AsyncLLM", model, engine_dir, kwargs, extra=("on_dead",))
        super().__init__(engine, **kwargs)
