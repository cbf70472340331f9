"""The Hugging Face tokenizer files a checkpoint dir and an engine dir carry, copied from the model
dir so that each is self-contained: convert and engine-build copy them, the runtime loads them."""
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
    "added_tokens.json",
)

# Any of these makes a tokenizer AutoTokenizer can load (the rest of TOKENIZER_FILES configure it).
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in TOKENIZER_VOCAB_FILES)


def copy_tokenizer_files(model_dir: Path, dest: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, dest / name)
            copied.append(name)
    return copied
