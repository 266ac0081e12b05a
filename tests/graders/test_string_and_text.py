"""string_check's operations, and each text_similarity metric equal to its reference library's value."""

from __future__ import annotations

import math
from functools import partial

import pytest
from nltk.tokenize import word_tokenize
from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
from nltk.translate.gleu_score import sentence_gleu
from nltk.translate.meteor_score import meteor_score
from rapidfuzz import fuzz, utils
from rouge_score import rouge_scorer

from graders import GradeContext, grade, make_sample, parse_grader


def string_check(operation: str, given: str, reference: str) -> float:
    grader = parse_grader(
        {
            "type": "string_check",
            "name": "s",
            "operation": operation,
            "input": "{{sample.output_text}}",
            "reference": "{{item.reference}}",
        },
        allow_python=False,
    )
    result = grade(grader, make_sample(given), {"reference": reference}, GradeContext())
    assert not result.errors.flags
    return result.reward


@pytest.mark.parametrize(
    ("operation", "given", "reference", "reward"),
    [
        ("eq", "Paris", "Paris", 1.0),
        ("eq", "paris", "Paris", 0.0),
        ("eq", "Paris ", "Paris", 0.0),
        ("eq", "", "", 1.0),
        ("ne", "Paris", "Paris", 0.0),
        ("ne", "paris", "Paris", 1.0),
        ("like", "The capital is Paris.", "Paris", 1.0),
        ("like", "The capital is paris.", "Paris", 0.0),
        ("like", "Paris", "The capital is Paris", 0.0),  # the input contains the reference, not the reverse
        ("like", "anything", "", 1.0),
        ("ilike", "THE CAPITAL IS PARIS.", "paris", 1.0),
        ("ilike", "Straße", "STRASSE", 1.0),  # full case folding
        ("ilike", "Lyon", "paris", 0.0),
    ],
)
def test_string_check(operation: str, given: str, reference: str, reward: float) -> None:
    assert string_check(operation, given, reference) == reward


def similarity(metric: str, given: str, reference: str) -> float:
    grader = parse_grader(
        {
            "type": "text_similarity",
            "evaluation_metric": metric,
            "input": "{{sample.output_text}}",
            "reference": "{{item.reference}}",
        },
        allow_python=False,
    )
    result = grade(grader, make_sample(given), {"reference": reference}, GradeContext())
    assert not result.errors.flags
    return result.reward


PAIRS = [
    ("The cat sat on the mat.", "The cat sat on the mat."),
    ("The cat sat on the mat.", "A cat was sitting on the mat."),
    ("the quick brown fox jumps over the lazy dog", "The quick brown dog jumps over the lazy fox!"),
    (
        "It is a guide to action which ensures that the military always obeys the commands of the party",
        "It is a guide to action that ensures that the military will forever heed Party commands",
    ),
    ("fuzzy wuzzy was a bear", "fuzzy wuzzy had no hair"),
    ("Cats are running quickly", "the cat runs quick"),
    ("42", "42"),
    ("42", "43"),
    ("", "something"),
    ("something", ""),
    ("", ""),
    ("naïve café — déjà vu", "naive cafe deja vu"),
]


def words(text: str) -> list[str]:
    return list(word_tokenize(text, preserve_line=True))


class NoSynonyms:
    def synsets(self, word: str) -> list[object]:
        return []


def rouge(kind: str, given: str, reference: str) -> float:
    return rouge_scorer.RougeScorer([kind]).score(reference, given)[kind].fmeasure


LIBRARY = {
    "fuzzy_match": lambda g, r: fuzz.WRatio(g, r, processor=utils.default_process) / 100,
    "bleu": lambda g, r: sentence_bleu([words(r)], words(g), smoothing_function=SmoothingFunction().method1),
    "gleu": lambda g, r: sentence_gleu([words(r)], words(g)),
    "meteor": lambda g, r: meteor_score([words(r)], words(g), wordnet=NoSynonyms()),
    **{f"rouge_{n}": partial(rouge, f"rouge{n}") for n in range(1, 6)},
    "rouge_l": partial(rouge, "rougeL"),
}


@pytest.mark.parametrize("metric", sorted(LIBRARY))
@pytest.mark.parametrize(("given", "reference"), PAIRS)
def test_each_metric_is_its_library(metric: str, given: str, reference: str) -> None:
    assert similarity(metric, given, reference) == pytest.approx(LIBRARY[metric](given, reference), abs=1e-9)


def test_rouge_l_is_the_librarys_on_long_and_random_texts() -> None:
    """rouge_l's LCS is computed bit-parallel, not by the library's table: the same scores on random texts
    over small vocabularies (many ties) and on two texts of 1,500 words."""
    import random

    rng = random.Random(3)
    for _ in range(300):
        vocab = [f"w{i}" for i in range(rng.randint(1, 6))]
        given = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 60)))
        reference = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 60)))
        assert similarity("rouge_l", given, reference) == pytest.approx(
            rouge("rougeL", given, reference), abs=1e-12
        )
    vocab = [f"w{i}" for i in range(40)]
    given, reference = (" ".join(rng.choice(vocab) for _ in range(1500)) for _ in range(2))
    assert similarity("rouge_l", given, reference) == pytest.approx(
        rouge("rougeL", given, reference), abs=1e-12
    )


@pytest.mark.parametrize(
    ("metric", "given", "reference", "expected"),
    [
        ("fuzzy_match", "Hello World!", "hello world", 1.0),  # default_process: lower case, no punctuation
        ("bleu", "a b c d", "a b c d", 1.0),
        ("bleu", "a b c d", "a b c d e", math.exp(1 - 5 / 4)),  # all precisions 1, brevity penalty
        ("gleu", "a b", "a c", 1 / 3),  # shared n-grams {a} of 3 each side
        ("meteor", "cat", "cat", 0.5),  # one match, one chunk: penalty 0.5 * (1/1)^3
        ("meteor", "cats", "cat", 0.5),  # a Porter stem match
        ("meteor", "the cat sat", "the cat sat", 1 - 0.5 * (1 / 3) ** 3),
        ("meteor", "big", "large", 0.0),  # WordNet would match these synonyms: without it they do not
        ("rouge_1", "the cat sat", "the cat", 0.8),  # P 2/3, R 1
        ("rouge_2", "the cat sat", "the cat", 2 / 3),  # P 1/2, R 1
        ("rouge_l", "a b c d", "a c d", 6 / 7),  # LCS 3: P 3/4, R 1
        ("rouge_5", "a b c d", "a b c d", 0.0),  # no 5-grams
    ],
)
def test_hand_computed(metric: str, given: str, reference: str, expected: float) -> None:
    assert similarity(metric, given, reference) == pytest.approx(expected, abs=1e-12)
