"""The speculative decoding part of the configuration chain (`config.py`: SchedulerConfig.speculative)."""

from __future__ import annotations

from dataclasses import dataclass

from disagg_api import speculative_settings as SP
from disagg_worker.errors import ConfigError
from disagg_worker.flags import from_flag

DRAFT_MODEL_ALGORITHMS = ("EAGLE", "STANDALONE")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`engine/speculative.py`, `engine/drafting.py`).

    NGRAM drafts from n-gram matches in the request's own tokens: the longest suffix of `max_match`..
    `min_match` tokens that occurred earlier proposes the tokens that followed it, up to `num_draft_tokens`.
    EAGLE (a one-layer head fed with the target's hidden states, `draft_model_path` in SGLang's EAGLE
    checkpoint layout) and STANDALONE (a smaller model with the same tokenizer) draft `num_steps` tokens,
    one forward of the draft each, as one chain (`eagle_topk` 1). Every draft is verified in the request's
    next forward."""

    algorithm: str = from_flag(SP.SPECULATIVE_ALGORITHM)  # "": off
    num_draft_tokens: int = from_flag(SP.SPECULATIVE_NUM_DRAFT_TOKENS)
    min_match: int = from_flag(SP.SPECULATIVE_NGRAM_MIN_MATCH_WINDOW_SIZE)
    max_match: int = from_flag(SP.SPECULATIVE_NGRAM_MAX_MATCH_WINDOW_SIZE)
    num_steps: int = from_flag(SP.SPECULATIVE_NUM_STEPS)
    eagle_topk: int = from_flag(SP.SPECULATIVE_EAGLE_TOPK)
    draft_model_path: str = from_flag(SP.SPECULATIVE_DRAFT_MODEL_PATH)

    @property
    def enabled(self) -> bool:
        return bool(self.algorithm)

    @property
    def uses_draft_model(self) -> bool:
        return self.algorithm in DRAFT_MODEL_ALGORITHMS

    @property
    def max_draft(self) -> int:
        """The most draft tokens one request verifies in one step."""
        return self.num_steps if self.uses_draft_model else self.num_draft_tokens

    def __post_init__(self) -> None:
        if self.algorithm and self.algorithm not in SP.SPECULATIVE_ALGORITHMS:
            raise ConfigError(
                f"--speculative-algorithm {self.algorithm}: one of {', '.join(SP.SPECULATIVE_ALGORITHMS)}"
            )
        if not self.algorithm:
            return
        if not 1 <= self.num_draft_tokens <= 16:
            raise ConfigError(f"--speculative-num-draft-tokens {self.num_draft_tokens}: from 1 to 16")
        if not 1 <= self.min_match <= self.max_match:
            raise ConfigError(
                f"--speculative-ngram-min-match-window-size {self.min_match} and "
                f"--speculative-ngram-max-match-window-size {self.max_match}: need 1 <= min <= max"
            )
        if not self.uses_draft_model:
            if self.draft_model_path:
                raise ConfigError(
                    f"--speculative-draft-model-path is for EAGLE and STANDALONE, not {self.algorithm} (it drafts "
                    "without a model)"
                )
            return
        if not self.draft_model_path:
            raise ConfigError(f"--speculative-algorithm {self.algorithm} needs --speculative-draft-model-path")
        if not 1 <= self.num_steps <= 16:
            raise ConfigError(f"--speculative-num-steps {self.num_steps}: from 1 to 16")
        if self.eagle_topk != 1:
            raise ConfigError(
                f"--speculative-eagle-topk {self.eagle_topk}: only 1 (one chain of drafts per request) is supported"
            )
