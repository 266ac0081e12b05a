"""text_similarity's metrics, each the value of the library OpenAI names or ships to its graders
(rapidfuzz 3.10, nltk 3.9, rouge-score 0.1.2 in its python-grader image), called, not re-implemented.

- fuzzy_match: rapidfuzz fuzz.WRatio with utils.default_process, / 100 (the graders guide's own example).
- bleu: nltk sentence_bleu, 4-gram uniform weights, SmoothingFunction().method1 (without smoothing any
  answer lacking a shared 4-gram scores 0, and nltk warns).
- gleu: nltk sentence_gleu (1- to 4-grams).
- meteor: nltk meteor_score (alpha 0.9, beta 3, gamma 0.5, lowercased, Porter stems) WITHOUT WordNet
  synonyms: nltk's WordNet is a corpus downloaded at run time, which a server without internet cannot do,
  and no PyPI package ships it for nltk; so words match exactly or by stem only, and METEOR here is <= what
  it is with WordNet (equal when no synonym pair would have matched).
- rouge_1..rouge_5, rouge_l: rouge-score's RougeScorer F-measure (rouge1..rouge5, rougeL; no stemming).
The input is the hypothesis and the reference the reference. bleu, gleu and meteor split words with nltk's
Treebank word tokenizer on the whole text (word_tokenize with preserve_line=True: the punkt sentence model
is another download). The libraries are imported on first use, keeping `core` quick to import."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

Metric = Callable[[str, str], float]  # (input, reference) -> score


class _NoSynonyms:
    """Stands in for nltk's WordNet reader in meteor_score: no word has synonyms."""

    def synsets(self, word: str) -> list[Any]:
        return []


def _words(text: str) -> list[str]:
    from nltk.tokenize import word_tokenize

    return list(word_tokenize(text, preserve_line=True))


def fuzzy_match(given: str, reference: str) -> float:
    from rapidfuzz import fuzz, utils

    return float(fuzz.WRatio(given, reference, processor=utils.default_process)) / 100.0


def bleu(given: str, reference: str) -> float:
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    return float(
        sentence_bleu([_words(reference)], _words(given), smoothing_function=SmoothingFunction().method1)
    )


def gleu(given: str, reference: str) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    return float(sentence_gleu([_words(reference)], _words(given)))


def meteor(given: str, reference: str) -> float:
    from nltk.translate.meteor_score import meteor_score

    return float(meteor_score([_words(reference)], _words(given), wordnet=_NoSynonyms()))


@cache
def _rouge_scorer(kind: str) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([kind], use_stemmer=False)


def _rouge(kind: str) -> Metric:
    def rouge(given: str, reference: str) -> float:
        return float(_rouge_scorer(kind).score(reference, given)[kind].fmeasure)

    return rouge


METRICS: dict[str, Metric] = {
    "fuzzy_match": fuzzy_match,
    "bleu": bleu,
    "gleu": gleu,
    "meteor": meteor,
    **{f"rouge_{n}": _rouge(f"rouge{n}") for n in range(1, 6)},
    "rouge_l": _rouge("rougeL"),
}
