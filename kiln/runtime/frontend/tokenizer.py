"""The frontend's tokenizer: the one engine-build copied into the engine dir, one given, or none."""
import os

from kiln.config import ConfigError
from kiln.tokenizer_files import TOKENIZER_VOCAB_FILES, has_tokenizer


def load_tokenizer(engine_dir):
    """The tokenizer in engine_dir (where engine-build copied it; or a HF model dir); a one-line error
    if there is none."""
    from transformers import AutoTokenizer  # heavy: only where a tokenizer is loaded

    fix = ("rebuild it with engine-build --tokenizer_dir <HF model dir>, or load it with "
           "skip_tokenizer_init=True (kiln serve --skip-tokenizer-init) and send prompt_token_ids")
    if not has_tokenizer(engine_dir):
        raise ConfigError(f"engine dir {engine_dir} has no tokenizer (none of "
                          f"{', '.join(TOKENIZER_VOCAB_FILES)}): {fix}")
    try:
        if _class_of(engine_dir) == "TokenizersBackend":
            # transformers 5's name for a plain tokenizer.json tokenizer, which transformers 4 has as
            # PreTrainedTokenizerFast (and its AutoTokenizer cannot resolve the name)
            from transformers import PreTrainedTokenizerFast
            from transformers.utils import logging

            verbosity = logging.get_verbosity()
            logging.set_verbosity_error()  # its warning that the class named differs is this very case
            try:
                return PreTrainedTokenizerFast.from_pretrained(str(engine_dir))
            finally:
                logging.set_verbosity(verbosity)
        return AutoTokenizer.from_pretrained(str(engine_dir))
    except Exception as e:  # transformers' own errors say nothing about where the files came from
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot load the tokenizer in engine dir {engine_dir} ({first}): {fix}") from None


def _class_of(engine_dir) -> str | None:
    import json
    from pathlib import Path

    try:
        return json.loads((Path(engine_dir) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def frontend_tokenizer(engine_dir, tokenizer, skip_tokenizer_init: bool):
    """The tokenizer given (an object, or as vLLM's `tokenizer` a dir to load it from), else the engine
    dir's; None with skip_tokenizer_init (vLLM's name: prompts are token ids, outputs have empty text).
    Loaded before the engine, so that a missing one fails fast."""
    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer(tokenizer)
    if tokenizer is not None or skip_tokenizer_init:
        return tokenizer
    return load_tokenizer(engine_dir)


def eos_token_ids(model_config, tokenizer) -> tuple[int, ...]:
    ids = model_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(sorted(set(ids)))
