"""The speculative decoding settings (part of `settings.ENGINE`): what drafts a request's next tokens, and how
many; every draft is verified in the request's next forward. SGLang's flags and names."""

from __future__ import annotations

from disagg_api.setting import Setting

SPECULATIVE_ALGORITHMS = ("NGRAM", "EAGLE", "STANDALONE")  # SGLang's names

SPECULATIVE_ALGORITHM = Setting(
    "--speculative-algorithm",
    str.upper,
    choices=("", *SPECULATIVE_ALGORITHMS),
    help="speculative decoding: NGRAM drafts from n-gram matches in the request's own tokens (no draft "
    "model); EAGLE from a one-layer draft head fed with the model's hidden states; STANDALONE from a smaller "
    "model with the same tokenizer (both: --speculative-draft-model-path, single-rank instances). Greedy and "
    "seeded answers stay token-identical. Turns overlap scheduling off",
    sglang="--speculative-algorithm",
)
SPECULATIVE_DRAFT_MODEL_PATH = Setting(
    "--speculative-draft-model-path",
    help="EAGLE: the draft head (SGLang's EAGLE checkpoint layout); STANDALONE: the draft model",
    sglang="--speculative-draft-model-path",
)
SPECULATIVE_NUM_STEPS = Setting(
    "--speculative-num-steps",
    int,
    3,
    help="EAGLE/STANDALONE: draft tokens per request and step (one draft forward each)",
    sglang="--speculative-num-steps",
)
SPECULATIVE_EAGLE_TOPK = Setting(
    "--speculative-eagle-topk",
    int,
    1,
    help="EAGLE/STANDALONE: drafts per position; 1 (a chain) is what is supported",
    sglang="--speculative-eagle-topk",
)
SPECULATIVE_NUM_DRAFT_TOKENS = Setting(
    "--speculative-num-draft-tokens",
    int,
    8,
    help="NGRAM: draft tokens verified with a request's decode step, at most",
    sglang="--speculative-num-draft-tokens",
)
SPECULATIVE_NGRAM_MIN_MATCH_WINDOW_SIZE = Setting(
    "--speculative-ngram-min-match-window-size",
    int,
    2,
    help="NGRAM: shortest suffix of the request's tokens that must have occurred before to propose a draft",
    sglang="--speculative-ngram-min-match-window-size",
)
SPECULATIVE_NGRAM_MAX_MATCH_WINDOW_SIZE = Setting(
    "--speculative-ngram-max-match-window-size",
    int,
    8,
    help="NGRAM: longest suffix matched (the longest one that occurred before proposes the draft)",
    sglang="--speculative-ngram-max-match-window-size",
)
SPECULATIVE = (
    SPECULATIVE_ALGORITHM,
    SPECULATIVE_DRAFT_MODEL_PATH,
    SPECULATIVE_NUM_STEPS,
    SPECULATIVE_EAGLE_TOPK,
    SPECULATIVE_NUM_DRAFT_TOKENS,
    SPECULATIVE_NGRAM_MIN_MATCH_WINDOW_SIZE,
    SPECULATIVE_NGRAM_MAX_MATCH_WINDOW_SIZE,
)
