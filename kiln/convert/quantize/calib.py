"""Calibration and evaluation text: local files read, tokenized and cut into windows of tokens.

A dataset is a .txt (or any text) file, a .jsonl file whose lines carry a "text" field, a directory
of such files (read recursively, sorted by path), or a list of any of these.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from kiln.config import ConfigError

TEXT_SUFFIXES = {".txt", ".text", ".md", ".rst", ".py", ".jsonl", ".json"}
# Calibration text when a TensorRT-LLM flag asks for calibration without a dataset: TensorRT-LLM's
# default (cnn_dailymail) is a download, and every machine running Kiln has Python's standard library
# (about 600 KB of code and English docstrings from these packages: some 200 windows of 512 tokens
# for the default model's tokenizer, as many as FP8's max calibration needs).
DEFAULT_PACKAGES = ("json", "http", "urllib", "logging")


def default_dataset() -> list[Path]:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    return [root / p for p in DEFAULT_PACKAGES if (root / p).is_dir()]


def _read_file(path: Path, what: str) -> list[str]:
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} file {path} is not UTF-8 text") from None
    if path.suffix != ".jsonl":
        return [raw] if raw.strip() else []
    texts = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{what} file {path} line {n} is not valid JSON: {e}") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ConfigError(f"{what} file {path} line {n} has no string \"text\" field")
        if record["text"].strip():
            texts.append(record["text"])
    return texts


def read_texts(dataset: str | Path | Sequence[str | Path], what: str = "calibration") -> list[str]:
    """Every document of `dataset`; raises ConfigError when a path is missing or there is no text.

    Empty files among others are skipped (a package's empty __init__.py); a dataset with no text
    at all is an error.
    """
    paths = [Path(dataset)] if isinstance(dataset, (str, Path)) else [Path(p) for p in dataset]
    if not paths:
        raise ConfigError(f"no {what} dataset given")
    texts: list[str] = []
    for path in paths:
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not files:
                raise ConfigError(f"{what} dataset {path} is a directory with no text files "
                                  f"(expected {', '.join(sorted(TEXT_SUFFIXES))})")
            texts += [t for f in files for t in _read_file(f, what)]
        elif path.is_file():
            texts += _read_file(path, what)
        else:
            raise ConfigError(f"{what} dataset {path} not found (expected a text or .jsonl file, or a "
                              f"directory of them)")
    if not texts:
        name = str(paths[0]) if len(paths) == 1 else f"of {len(paths)} paths ({paths[0]}, ...)"
        raise ConfigError(f"{what} dataset {name} is empty (no text to "
                          f"{'calibrate' if what == 'calibration' else 'evaluate'} on)")
    return texts


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one stream, each encoded as the model would see it (BOS first, if any)."""
    ids = tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
    return torch.tensor([t for doc in ids for t in doc], dtype=torch.long)


def windows(stream: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Windows of seq_len + 1 tokens at stride seq_len: seq_len inputs, each with its next token.

    The last, shorter window is kept (if it predicts anything), so every token is scored once.
    """
    return [w for w in (stream[s:s + seq_len + 1] for s in range(0, len(stream) - 1, seq_len))
            if len(w) >= 2]


@dataclass
class Split:
    calib: list[torch.Tensor]  # model inputs for calibration
    eval: list[torch.Tensor]  # windows to score (inputs plus the next token)
    eval_source: str


def _spread(items: list, n: int) -> list:
    """n items spread evenly over the list (all of them when n is 0 or too big)."""
    if n <= 0 or n >= len(items):
        return items
    return [items[i * len(items) // n] for i in range(n)]


def make_split(tokenizer, calib_texts: list[str] | None, eval_texts: list[str] | None,
               calib_size: int, seq_len: int, eval_size: int, seed: int = 0) -> Split:
    """Calibration windows, and evaluation windows that calibration never saw.

    Without eval_texts the evaluation set is the calibration data's windows left after drawing
    the calibration ones (a fifth of them at least, so that there is something to score).
    """
    calib_windows = windows(token_stream(tokenizer, calib_texts), seq_len) if calib_texts else []
    order = torch.randperm(len(calib_windows), generator=torch.Generator().manual_seed(seed)).tolist()
    shuffled = [calib_windows[i] for i in order]
    if eval_texts is not None:
        held = windows(token_stream(tokenizer, eval_texts), seq_len)
        n_calib = min(calib_size, len(shuffled))
        source = f"--eval_dataset ({len(eval_texts)} document(s))"
    else:
        if calib_texts and len(shuffled) < 2:
            raise ConfigError(f"calibration dataset has too little text ({len(shuffled)} window(s) of "
                              f"{seq_len} tokens) to hold some out for the accuracy report; add text "
                              f"or pass --eval_dataset")
        n_calib = min(calib_size, len(shuffled) - max(1, len(shuffled) // 5))
        held = shuffled[n_calib:]
        source = "held-out windows of --calib_dataset (never used for calibration)"
    calib = [w[:seq_len] for w in shuffled[:n_calib]]
    return Split(calib=calib, eval=_spread(held, eval_size), eval_source=source)


def batches(items: list[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    """Stack equally long tensors into batches; odd lengths go alone."""
    by_len: dict[int, list[torch.Tensor]] = {}
    for t in items:
        by_len.setdefault(len(t), []).append(t)
    return [torch.stack(group[i:i + batch_size]) for group in by_len.values()
            for i in range(0, len(group), batch_size)]
