"""Per-request sampling parameters, shared by the HTTP layer, the OfflineEngine,
the record layouts and the sampler."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs, and the most logprob_token_ids names
# A logprobs count of -1 (vLLM's: every token of the vocabulary) as parsed before the vocabulary
# is known: a count no vocabulary reaches, which resolve() turns into the vocabulary's size.
WHOLE_VOCABULARY = 1 << 30
# The most alternatives one request may ask for in all (positions times count per position,
# over its choices), whatever --max-logprobs allows: each becomes a JSON object of the answer,
# built in the HTTP worker's memory (a vocabulary's worth of a 40-token prompt fits).
MAX_LOGPROB_ENTRIES = 1 << 21
MAX_STOP_STRINGS = 16
# Stop strings travel with every choice of a request (n of them) through the REQUEST and
# TOKEN_OUT rings, and every decoded token is matched against them: bounded in UTF-8 bytes,
# each and in all, so that a request's choices fit the rings' arenas (protocol/records.py).
MAX_STOP_STRING_BYTES = 4096
MAX_STOP_BYTES = 8192
MAX_STOP_TOKEN_IDS = 16
# The sampler divides float32 logits by the temperature and the repetition penalty: a smaller
# temperature (1e-320 is 0 in float32) or penalty overflows them to inf and the distribution
# to NaN, which samples no token. Below GREEDY_TEMPERATURE sampling is greedy (vLLM's and
# SGLang's epsilon); a penalty below MIN_REPETITION_PENALTY is refused.
GREEDY_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 2.0
MAX_TEMPERATURE = 2.0
MAX_ABS_PENALTY = 2.0  # frequency_penalty and presence_penalty, OpenAI's range
# validate()'s inclusive ranges of the float parameters (top_p's, (0, 1], is checked apart), which
# the HTTP layer shows in its OpenAPI document (httpapi/sampling.py)
FLOAT_RANGES = {
    "temperature": (0.0, MAX_TEMPERATURE),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
    "frequency_penalty": (-MAX_ABS_PENALTY, MAX_ABS_PENALTY),
    "presence_penalty": (-MAX_ABS_PENALTY, MAX_ABS_PENALTY),
}
# A grammar travels with every choice through the REQUEST ring and is compiled once per text
# (a tool-calling request's schema holds its tools': structured/tools.py MAX_TOOLS_BYTES).
MAX_GRAMMAR_BYTES = 256 << 10
# logit_bias: OpenAI's range; entries bounded so a request's bias rows stay small on every step
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 4096  # vLLM's allowed_token_ids: a request's list rides its REQUEST payload
MAX_THINK_MARKER_IDS = 16  # the reasoning's start and end markers, as token ids
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LORA_ID = 0xFFFF  # REQUEST.lora_id is a u16


class GrammarKind(enum.IntEnum):
    """What SamplingParams.grammar holds."""

    NONE = 0
    JSON_SCHEMA = 1  # a JSON schema's text (json_object: {"type": "object"})
    REGEX = 2
    EBNF = 3  # GBNF, as xgrammar reads it
    STRUCTURAL_TAG = 4  # xgrammar's structural tag, as JSON


class Pooling(enum.IntEnum):
    """What a request gives back instead of generated tokens (SamplingParams.pooling)."""

    NONE = 0  # generation
    LAST = 1  # the last prompt token's final hidden state (decoder embedding models)
    MEAN = 2  # the mean of every prompt token's
    CLS = 3  # the first prompt token's
    LABELS = 4  # the log-softmax of the next-token logits after the prompt, at allowed_token_ids (scores)


class InvalidParam(ValueError):
    """A request parameter is out of range; `param` names it as the API spells it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    no_stop_trim: bool = False  # keep the matched stop string / stop token's text in the output
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs: int = 0  # number of alternatives per position, needs logprobs
    return_ids: bool = False  # the output's token ids reach the HTTP worker (/generate's output_ids)
    grammar_kind: int = GrammarKind.NONE  # the output must match `grammar` (constrained decoding)
    grammar: str = ""
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit before sampling)
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: the only tokens it may sample (empty: any)
    # vLLM's logprob_token_ids: these tokens' logprobs stand in for the top_logprobs ones (top_logprobs
    # is their count), whatever their rank
    logprob_token_ids: tuple[int, ...] = ()
    prompt_logprobs: int = -1  # -1: none; else each prompt token's logprob and this many top alternatives
    prompt_logprobs_start: int = 0  # the first prompt position reported (SGLang's logprob_start_len)
    # vLLM's thinking_token_budget: at most this many reasoning tokens (-1: no bound), then the
    # reasoning's end (think_end_ids) is forced. The reasoning starts with the first token, or
    # once the model wrote think_start_ids when they are given.
    thinking_budget: int = -1
    think_start_ids: tuple[int, ...] = ()
    think_end_ids: tuple[int, ...] = ()
    # Pooling.NONE: generate; else prefill only, then one POOLED record and no token (runtime/
    # scheduler/pooling.py); LABELS reads its label token ids from allowed_token_ids
    pooling: int = Pooling.NONE
    # the LoRA adapter the request runs with: 0 the base model, i the i-th of --lora-paths (the
    # scheduler refuses an id it has no adapter for)
    lora_id: int = 0
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def constrained(self) -> bool:
        return self.grammar_kind != GrammarKind.NONE

    @property
    def penalized(self) -> bool:
        """Its logits depend on the tokens it generated (repetition, frequency, presence)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raises InvalidParam naming the first parameter out of range; returns self.
        Straight-line checks: a request is validated three times on its way (request,
        prompt, scheduler), and a helper call per check cost more than the checks."""
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise InvalidParam("max_tokens", "max_tokens must be at least 1")
        if not (isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens <= self.max_new_tokens):
            raise InvalidParam("min_tokens", "min_tokens must be between 0 and max_tokens")
        if not (_finite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidParam("temperature", f"temperature must be between 0 and {MAX_TEMPERATURE:g}")
        if not (_finite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidParam("top_p", "top_p must be in (0, 1]")
        if not (isinstance(self.top_k, int) and -1 <= self.top_k < 2**31):  # records hold it as int32
            raise InvalidParam("top_k", "top_k must be -1 (disabled), 0 (disabled) or a positive integer below 2^31")
        if not (_finite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise InvalidParam("min_p", "min_p must be in [0, 1]")
        if not (self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63)):
            raise InvalidParam("seed", "seed must be a 64-bit integer")
        if not (
            _finite(self.repetition_penalty)
            and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            raise InvalidParam(
                "repetition_penalty",
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}]",
            )
        if not (_finite(self.frequency_penalty) and -MAX_ABS_PENALTY <= self.frequency_penalty <= MAX_ABS_PENALTY):
            raise InvalidParam(
                "frequency_penalty", f"frequency_penalty must be between {-MAX_ABS_PENALTY:g} and {MAX_ABS_PENALTY:g}"
            )
        if not (_finite(self.presence_penalty) and -MAX_ABS_PENALTY <= self.presence_penalty <= MAX_ABS_PENALTY):
            raise InvalidParam(
                "presence_penalty", f"presence_penalty must be between {-MAX_ABS_PENALTY:g} and {MAX_ABS_PENALTY:g}"
            )
        if not (len(self.stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in self.stop)):
            raise InvalidParam("stop", f"stop must be at most {MAX_STOP_STRINGS} non-empty strings")
        if self.stop and _stop_bytes(self.stop) > MAX_STOP_BYTES:
            raise InvalidParam(
                "stop",
                f"stop strings must be at most {MAX_STOP_STRING_BYTES} bytes each and {MAX_STOP_BYTES} bytes "
                f"in all (UTF-8)",
            )
        if not (
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
            and all(
                isinstance(t, int) and t >= 0 and (vocab_size is None or t < vocab_size) for t in self.stop_token_ids
            )
        ):
            raise InvalidParam(
                "stop_token_ids", f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids in the vocabulary"
            )
        most = WHOLE_VOCABULARY if vocab_size is None else vocab_size  # per position: the vocabulary
        vocab = "the vocabulary's size" if vocab_size is None else f"{vocab_size}, the vocabulary's size"
        if not (isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= most):
            raise InvalidParam("top_logprobs", f"top_logprobs must be between 0 and {vocab}")
        if not (self.top_logprobs == 0 or self.logprobs):
            raise InvalidParam("top_logprobs", "top_logprobs needs logprobs to be true")
        if self.logprob_token_ids and not (
            len(self.logprob_token_ids) == self.top_logprobs
            and all(
                isinstance(t, int) and t >= 0 and (vocab_size is None or t < vocab_size) for t in self.logprob_token_ids
            )
        ):
            raise InvalidParam(
                "logprob_token_ids",
                f"logprob_token_ids must be at most {MAX_TOP_LOGPROBS} token ids in the vocabulary",
            )
        if self.grammar_kind != GrammarKind.NONE or self.grammar:
            self._validate_grammar()
        if self.logit_bias:
            self._validate_logit_bias(vocab_size)
        if self.allowed_token_ids and not (
            len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
            and all(
                isinstance(t, int) and t >= 0 and (vocab_size is None or t < vocab_size) for t in self.allowed_token_ids
            )
        ):
            raise InvalidParam(
                "allowed_token_ids",
                f"allowed_token_ids must be at most {MAX_ALLOWED_TOKEN_IDS} token ids in the vocabulary",
            )
        if not (isinstance(self.prompt_logprobs, int) and -1 <= self.prompt_logprobs <= most):
            raise InvalidParam("prompt_logprobs", f"prompt_logprobs must be between 0 and {vocab}")
        if not (isinstance(self.prompt_logprobs_start, int) and 0 <= self.prompt_logprobs_start < 2**31):
            raise InvalidParam("prompt_logprobs_start", "the prompt logprobs' start must be a position in the prompt")
        if self.thinking_budget != -1:
            self._validate_thinking_budget(vocab_size)
        if self.pooling not in _POOLINGS:
            raise InvalidParam("pooling", f"pooling {self.pooling} is not one of {list(Pooling)}")
        if not (isinstance(self.lora_id, int) and 0 <= self.lora_id <= MAX_LORA_ID):
            raise InvalidParam("lora_id", f"a LoRA adapter id is in [0, {MAX_LORA_ID}]")
        if self.pooling == Pooling.LABELS and not self.allowed_token_ids:
            raise InvalidParam("label_token_ids", "a score needs at least one label token id")
        return self

    def _validate_grammar(self) -> None:
        if self.grammar_kind not in _GRAMMAR_KINDS:
            raise InvalidParam("grammar", f"grammar kind {self.grammar_kind} is not one of {list(GrammarKind)}")
        if not (isinstance(self.grammar, str) and self.grammar):
            raise InvalidParam("grammar", "a grammar must be a non-empty string")
        if len(self.grammar) > MAX_GRAMMAR_BYTES or len(self.grammar.encode()) > MAX_GRAMMAR_BYTES:
            raise InvalidParam(
                "grammar", f"a grammar (schema, regex or EBNF) must be at most {MAX_GRAMMAR_BYTES} bytes"
            )

    def _validate_thinking_budget(self, vocab_size: int | None) -> None:
        if not (isinstance(self.thinking_budget, int) and 0 <= self.thinking_budget < 2**31):
            raise InvalidParam("thinking_budget", "thinking_token_budget must be -1 (no bound) or a token count")
        for ids, needed in ((self.think_start_ids, False), (self.think_end_ids, True)):
            if not (
                (ids or not needed)
                and len(ids) <= MAX_THINK_MARKER_IDS
                and all(isinstance(t, int) and t >= 0 and (vocab_size is None or t < vocab_size) for t in ids)
            ):
                raise InvalidParam("thinking_budget", "the reasoning's markers must be token ids in the vocabulary")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidParam("logit_bias", f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens")
        for entry in self.logit_bias:
            token, bias = entry if isinstance(entry, tuple) and len(entry) == 2 else (None, None)
            if not (isinstance(token, int) and 0 <= token and (vocab_size is None or token < vocab_size)):
                size = "" if vocab_size is None else f" (the model has {vocab_size} tokens)"
                raise InvalidParam("logit_bias", f"logit_bias has token id {token!r}, out of vocabulary{size}")
            if not (_finite(bias) and -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS):
                raise InvalidParam(
                    "logit_bias",
                    f"logit_bias values must be between {-MAX_ABS_LOGIT_BIAS:g} and {MAX_ABS_LOGIT_BIAS:g}",
                )


_POOLINGS = frozenset(int(k) for k in Pooling)
_GRAMMAR_KINDS = frozenset(int(k) for k in GrammarKind if k != GrammarKind.NONE)


def _stop_bytes(stop: tuple[str, ...]) -> int:
    """The stop strings' UTF-8 bytes in all, or past MAX_STOP_BYTES when one string is over
    MAX_STOP_STRING_BYTES; a string's length in characters bounds its bytes from below, so a
    huge one is refused without encoding it."""
    total = 0
    for s in stop:
        size = len(s) if len(s) > MAX_STOP_STRING_BYTES or s.isascii() else len(s.encode())
        if size > MAX_STOP_STRING_BYTES:
            return MAX_STOP_BYTES + 1
        total += size
    return total


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
