"""Per-request sampling parameters (vLLM's names, defaults and semantics), the guide that
constrains a request's output (TensorRT-LLM's GuidedDecodingParams), and the error a request the
engine refuses raises."""

from __future__ import annotations

import json as jsonlib
import math
import re
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are treated as greedy (as vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


class InvalidRequestError(ValueError):
    """A request the engine refuses: a parameter out of range here, or a prompt that does not fit
    (the frontend's input processor). `parameter` names the request field at fault in vLLM's names
    (OpenAI's, where OpenAI has the field), or is None where no one field is, as vLLM's
    VLLMValidationError does: `kiln serve` answers a 400 naming it."""

    def __init__(self, message: str, parameter: str | None = None):
        super().__init__(message)
        self.parameter = parameter


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


GUIDE_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class GuidedDecodingParams:
    """Constrains a request's output to a grammar, enforced token by token (xgrammar: a bitmask of the
    allowed tokens is applied to the logits before any sampling parameter), as TensorRT-LLM's
    ``GuidedDecodingParams`` and vLLM's ``StructuredOutputsParams`` name it. Exactly one of:

    - ``json``: a JSON schema, as a JSON string, a dict or a pydantic model class;
    - ``regex``: a regular expression the whole output matches;
    - ``choice``: a list of strings, the output being one of them;
    - ``grammar``: an EBNF grammar (GBNF style, start rule ``root``);
    - ``json_object``: any JSON object;
    - ``structural_tag``: xgrammar's structural tag, as a JSON string or a dict.

    ``disable_any_whitespace`` (vLLM's name): JSON without whitespace between its tokens. On by
    default: a small or unsure model allowed any whitespace pads its JSON with newlines until
    max_tokens (benchmarks/guided.py measures both). A request whose output reaches max_tokens
    before the grammar completes finishes with ``length``: its output is a prefix, not a valid one.
    Invalid guides raise ``InvalidRequestError`` (a ``ValueError``) naming the field and the parser's
    message (``check``)."""

    json: str | dict | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = True
    _checked: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.json, type):  # a pydantic model class
            schema = getattr(self.json, "model_json_schema", None)
            if schema is None:
                raise _bad_guide(f"guided_decoding.json must be a JSON schema (str or dict) or a pydantic "
                                 f"model class, got the class {self.json.__name__}")
            self.json = schema()
        if isinstance(self.json, dict):
            self.json = jsonlib.dumps(self.json)
        if isinstance(self.structural_tag, dict):
            self.structural_tag = jsonlib.dumps(self.structural_tag)
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        set_ = [k for k in GUIDE_KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise _bad_guide(f"guided_decoding must set exactly one of {', '.join(GUIDE_KINDS)}; got "
                             f"{', '.join(set_) if set_ else 'none'}")
        for name in ("json", "regex", "grammar", "structural_tag"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise _bad_guide(f"guided_decoding.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise _bad_guide(f"guided_decoding.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")
        if not isinstance(self.json_object, bool) or not isinstance(self.disable_any_whitespace, bool):
            raise _bad_guide("guided_decoding.json_object and disable_any_whitespace must be bools")

    @property
    def kind(self) -> str:
        return next(k for k in GUIDE_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar: guides with equal keys share one."""
        return self.kind, getattr(self, self.kind), self.disable_any_whitespace

    def to_grammar(self):
        """The guide as an ``xgrammar.Grammar`` (independent of the tokenizer; InvalidRequestError if
        invalid)."""
        import xgrammar as xgr

        kind, value = self.kind, getattr(self, self.kind)
        try:
            if kind in ("json", "json_object"):
                schema = value if kind == "json" else '{"type": "object"}'
                # any_whitespace=False writes JSON as json.dumps does: ", " and ": " separators.
                return xgr.Grammar.from_json_schema(schema, any_whitespace=not self.disable_any_whitespace)
            if kind == "regex":
                return xgr.Grammar.from_regex(value)
            if kind == "choice":
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(jsonlib.dumps(c, ensure_ascii=False)
                                                                         for c in value))
            if kind == "grammar":
                return xgr.Grammar.from_ebnf(value)
            return xgr.Grammar.from_structural_tag(value)
        except (RuntimeError, ValueError, TypeError) as e:
            raise _bad_guide(f"guided_decoding.{kind} is not valid: {_parser_message(e)}") from None

    def check(self) -> None:
        """Raises InvalidRequestError naming the field and the parser's message if the guide does not
        parse."""
        if not self._checked:
            self.to_grammar()
            self._checked = True


def _bad_guide(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, "guided_decoding")


def _parser_message(e: Exception) -> str:
    """xgrammar's error without its timestamp, source file and check prefix."""
    text = str(e).strip()
    text = re.sub(r"^\[[\d:.]+\] [^:]+:\d+: ", "", text)
    return re.sub(r"^Check failed: .*? is false: ", "", text).splitlines()[0] if text else type(e).__name__


@dataclass
class SamplingParams:
    """Sampling parameters of one request.

    ``top_k`` of 0 or -1 disables top-k; ``max_tokens=None`` generates until ``max_seq_len``;
    ``stop``, ``stop_token_ids`` and ``bad_words_ids`` are normalized to lists; a bad word (token
    ids) never completes: its last token is banned wherever the sequence ends with the rest of it.
    ``logprobs``/``prompt_logprobs`` ask for that many top tokens (plus the sampled / actual
    token), computed from the raw logits.
    ``return_context_logits`` / ``return_generation_logits`` (TensorRT-LLM's names) return the raw
    logits at every prompt position (``RequestOutput.context_logits``) and the logits each output
    token was sampled from (``CompletionOutput.generation_logits``).
    ``use_beam_search`` (TensorRT-LLM's and vLLM's names): a beam search of width ``best_of`` (default
    ``n``) returning its ``n`` best hypotheses, best first, scored by ``cumulative_logprob /
    len ** length_penalty`` with Hugging Face's ``early_stopping`` (True, False or ``"never"``); the
    beams are scored on ``log_softmax(logits / temperature)`` (0 and 1: the model's own), and the
    outputs arrive once the search is done (``logprobs=0``: with each token's log-probability).
    Invalid values raise ``InvalidRequestError`` (a ``ValueError``) naming the field, the value and
    what was expected.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words_ids: list[list[int]] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    guided_decoding: GuidedDecodingParams | None = None
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if isinstance(self.guided_decoding, dict):
            self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)
        # --- normalization -------------------------------------------------------------
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise InvalidRequestError(f"stop must be a str, a list of str or None, got {self.stop!r}", "stop")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise InvalidRequestError(
                f"stop_token_ids must be a list of int or None, got {self.stop_token_ids!r}", "stop_token_ids")
        if self.bad_words_ids is None:
            self.bad_words_ids = []
        elif isinstance(self.bad_words_ids, (list, tuple)) and all(isinstance(w, (list, tuple))
                                                                     for w in self.bad_words_ids):
            self.bad_words_ids = [list(w) for w in self.bad_words_ids]
        else:
            raise InvalidRequestError(f"bad_words_ids must be a list of token id lists or None, "
                                      f"got {self.bad_words_ids!r}", "bad_words_ids")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "length_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v):
                raise InvalidRequestError(f"{name} must be a finite number, got {v!r}", name)
            setattr(self, name, float(v))
        self._validate()

    def _validate(self) -> None:
        def bad(field: str, expected: str) -> InvalidRequestError:
            return InvalidRequestError(f"{field} must be {expected}, got {getattr(self, field)!r}", field)

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", ">= 1")
        if self.temperature < 0:
            raise bad("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or self.top_k >= 1):
            raise bad("top_k", "-1 or 0 (disabled) or an int >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "an int or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an int >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                                      f"got {self.min_tokens!r}", "min_tokens")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop must contain only non-empty strings, got {s!r}", "stop")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise InvalidRequestError(f"stop_token_ids must contain only ints >= 0, got {t!r}", "stop_token_ids")
        for w in self.bad_words_ids:
            if not w or not all(_is_int(t) and t >= 0 for t in w):
                raise InvalidRequestError(f"bad_words_ids must contain non-empty lists of ints >= 0, got {w!r}",
                                          "bad_words_ids")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a bool")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise bad(name, "an int >= 0 or None")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0")
        for name in ("skip_special_tokens", "include_stop_str_in_output", "return_context_logits",
                     "return_generation_logits"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise bad("guided_decoding", "a GuidedDecodingParams, a dict of its fields, or None")
        self._validate_beam_search()

    def _validate_beam_search(self) -> None:
        if not isinstance(self.use_beam_search, bool):
            raise InvalidRequestError(f"use_beam_search must be a bool, got {self.use_beam_search!r}",
                                      "use_beam_search")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise InvalidRequestError(f"best_of must be an int >= n ({self.n}) or None, got {self.best_of!r}",
                                      "best_of")
        if not self.use_beam_search:
            if self.best_of not in (None, self.n):
                raise InvalidRequestError(f"best_of ({self.best_of}) > n ({self.n}) needs use_beam_search: "
                                          f"sampling best_of candidates to return n is not supported", "best_of")
            return
        if self.early_stopping not in (True, False, "never"):
            raise InvalidRequestError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}",
                                      "early_stopping")
        # What beam search does not combine with, rather than silently ignored.
        unsupported = {"top_p": self.top_p != 1.0, "top_k": self.top_k not in (-1, 0), "min_p": self.min_p != 0,
                       "presence_penalty": self.presence_penalty != 0, "frequency_penalty": self.frequency_penalty != 0,
                       "repetition_penalty": self.repetition_penalty != 1, "bad_words_ids": bool(self.bad_words_ids),
                       "logprobs": self.logprobs not in (None, 0), "guided_decoding": self.guided_decoding is not None,
                       "return_generation_logits": self.return_generation_logits}
        used = [name for name, set_ in unsupported.items() if set_]
        if used:
            raise InvalidRequestError(f"use_beam_search does not support {', '.join(used)} (beams are scored on "
                                      f"the model's log-probabilities, optionally with a temperature and min_tokens)",
                                      "use_beam_search")

    @property
    def beam_width(self) -> int:
        """The beams of a beam search (best_of, else n); 1 without."""
        return (self.best_of or self.n) if self.use_beam_search else 1

    @property
    def num_sequences(self) -> int:
        """The sequences the request runs at once: its beams, or its n samples."""
        return self.beam_width if self.use_beam_search else self.n

    @property
    def greedy(self) -> bool:
        """True when the sampler takes the argmax (temperature ~0 or top_k == 1)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
