"""Schema of `spec.speculative`: speculative decoding, the same for both roles, and its CEL rules."""

from disagg_api import settings as S

from .schema import integer, obj, rule, string

SPECULATIVE_RULES: list[tuple[str, str, str]] = [
    (
        "spec.speculative",
        "self.ngramMinMatchWindowSize <= self.ngramMaxMatchWindowSize",
        "speculative.ngramMinMatchWindowSize must not exceed speculative.ngramMaxMatchWindowSize",
    ),
    (
        "spec.speculative",
        "self.algorithm == 'NGRAM' ? !has(self.draftModelPath) : has(self.draftModelPath)",
        "speculative.draftModelPath is the draft of EAGLE (its head) and STANDALONE (a smaller model); NGRAM "
        "takes none",
    ),
    (
        "spec",
        "!has(self.speculative) || !has(self.speculative.draftModelPath) || has(self.model.pvc) || "
        "has(self.model.hostPath)",
        "speculative.draftModelPath is read from the model's volume: it needs model.pvc or model.hostPath",
    ),
    (
        "spec",
        "!has(self.speculative) || self.speculative.algorithm == 'NGRAM' || (self.prefill.tpSize * "
        "self.prefill.ppSize == 1 && self.decode.tpSize * self.decode.ppSize == 1)",
        "speculative EAGLE and STANDALONE run on single-rank instances (tpSize and ppSize 1); NGRAM works with any",
    ),
]


def _rules_at(where: str) -> list[dict]:
    return [rule(expression, message) for w, expression, message in SPECULATIVE_RULES if w == where]


def speculative_schema() -> dict:
    return obj(
        {
            "algorithm": string(
                "NGRAM: drafts from n-gram matches in each request's own tokens (no draft model); EAGLE: from a "
                "one-layer draft head fed with the model's hidden states; STANDALONE: from a smaller model with the "
                "same tokenizer. Drafts are verified in the request's next decode step: answers stay token-identical.",
                16,
                enum=list(S.SPECULATIVE_ALGORITHMS),
            ),
            "numDraftTokens": integer(8, 1, "NGRAM: draft tokens verified with a decode step, at most.", 16),
            "numSteps": integer(3, 1, "EAGLE and STANDALONE: draft tokens per request and decode step.", 16),
            "draftModelPath": string(
                "EAGLE and STANDALONE: directory of the draft inside the model's volume (model.pvc or "
                "model.hostPath). Prefill runs it over the prompt and sends its KV with the model's pages.",
                1024,
            ),
            "ngramMinMatchWindowSize": integer(
                2, 1, "Shortest suffix of a request's tokens that must have occurred before to draft.", 64
            ),
            "ngramMaxMatchWindowSize": integer(8, 1, "Longest suffix matched.", 64),
        },
        "Speculative decoding, the same for both roles (decode drafts; prefill runs a draft model over the prompt, "
        "NGRAM needs nothing from it). Absent: off.",
        required=["algorithm"],
        rules=_rules_at("spec.speculative"),
    )
