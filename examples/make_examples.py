"""Write examples/alpaca_small.jsonl, examples/chat_small.jsonl, examples/preference_small.jsonl,
examples/rft_small.jsonl and the reinforcement toy's toy_words_sft.jsonl and toy_words_rft.jsonl
(deterministic: same output every run).

.venv/bin/python examples/make_examples.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

CAPITALS = [
    ("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
    ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Brazil", "Brasília"), ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"), ("India", "New Delhi"), ("China", "Beijing"), ("Mexico", "Mexico City"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Poland", "Warsaw"),
    ("Portugal", "Lisbon"), ("Greece", "Athens"), ("Turkey", "Ankara"), ("Argentina", "Buenos Aires"),
    ("Chile", "Santiago"), ("Peru", "Lima"), ("Ireland", "Dublin"), ("Austria", "Vienna"),
    ("Hungary", "Budapest"), ("Vietnam", "Hanoi"), ("Thailand", "Bangkok"), ("Nigeria", "Abuja"),
    ("Morocco", "Rabat"), ("New Zealand", "Wellington"), ("South Korea", "Seoul"),
]  # fmt: skip
OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
    ("open", "closed"), ("early", "late"), ("full", "empty"), ("hard", "soft"), ("old", "young"),
    ("rich", "poor"), ("strong", "weak"), ("wet", "dry"), ("loud", "quiet"), ("high", "low"),
    ("thick", "thin"), ("heavy", "light"), ("clean", "dirty"), ("brave", "cowardly"), ("near", "far"),
    ("win", "lose"), ("buy", "sell"), ("push", "pull"), ("remember", "forget"), ("always", "never"),
]  # fmt: skip
PLURALS = [
    ("cat", "cats"), ("box", "boxes"), ("child", "children"), ("mouse", "mice"), ("city", "cities"),
    ("knife", "knives"), ("tooth", "teeth"), ("woman", "women"), ("leaf", "leaves"), ("bus", "buses"),
    ("sheep", "sheep"), ("goose", "geese"), ("baby", "babies"), ("potato", "potatoes"), ("man", "men"),
    ("person", "people"), ("dish", "dishes"), ("wolf", "wolves"), ("fish", "fish"), ("church", "churches"),
    ("party", "parties"), ("foot", "feet"), ("key", "keys"), ("hero", "heroes"), ("cactus", "cacti"),
]  # fmt: skip
WORDS = [
    "planet", "garden", "yellow", "window", "silver", "rocket", "bridge", "candle", "forest", "pencil",
    "orange", "dragon", "winter", "button", "castle", "guitar", "island", "jacket", "kitten", "ladder",
    "marble", "needle", "pepper", "rabbit", "saddle", "tunnel", "velvet", "wizard", "anchor", "basket",
]  # fmt: skip
FACTS = [
    ("How many days are in a week?", "Seven."),
    ("How many legs does a spider have?", "Eight."),
    ("What is the boiling point of water at sea level in Celsius?", "100 °C."),
    ("What gas do plants absorb from the air?", "Carbon dioxide."),
    ("Which planet is closest to the Sun?", "Mercury."),
    ("What is the largest ocean on Earth?", "The Pacific Ocean."),
    ("How many continents are there?", "Seven."),
    ("What is frozen water called?", "Ice."),
    ("How many hours are in a day?", "Twenty-four."),
    ("Which animal is known as the king of the jungle?", "The lion."),
    ("What colour do you get by mixing blue and yellow?", "Green."),
    ("How many minutes are in an hour?", "Sixty."),
    ("What is the chemical symbol for gold?", "Au."),
    ("Which organ pumps blood around the body?", "The heart."),
    ("How many sides does a hexagon have?", "Six."),
    ("What is the tallest mountain above sea level?", "Mount Everest."),
    ("Which planet is known as the Red Planet?", "Mars."),
    ("What do bees make?", "Honey."),
    ("How many months have 28 days?", "All twelve months have at least 28 days."),
    ("What is the freezing point of water in Fahrenheit?", "32 °F."),
    ("Which direction does the Sun rise in?", "The east."),
    ("How many strings does a standard guitar have?", "Six."),
    ("What is the largest mammal?", "The blue whale."),
    ("What is the main language spoken in Brazil?", "Portuguese."),
    ("How many bones are in the adult human body?", "206."),
    ("Which is the longest river in Africa?", "The Nile."),
    ("What is the square root of 81?", "9."),
    ("How many players are on a football (soccer) team on the pitch?", "Eleven."),
]


def arithmetic(rng: random.Random, n: int) -> list[dict[str, Any]]:
    ops = [
        ("+", "Add", lambda a, b: a + b),
        ("-", "Subtract", lambda a, b: a - b),
        ("*", "Multiply", lambda a, b: a * b),
    ]
    out, seen = [], set()
    while len(out) < n:
        sym, verb, fn = rng.choice(ops)
        a, b = rng.randint(2, 60), rng.randint(2, 30 if sym == "*" else 60)
        if (a, sym, b) in seen:
            continue
        seen.add((a, sym, b))
        if rng.random() < 0.5:
            out.append({"instruction": f"What is {a} {sym} {b}?", "input": "", "output": str(fn(a, b))})
        else:
            noun = {"+": "sum", "-": "difference", "*": "product"}[sym]
            out.append(
                {
                    "instruction": f"{verb} the two numbers and give the {noun}.",
                    "input": f"{a} and {b}",
                    "output": f"The {noun} of {a} and {b} is {fn(a, b)}.",
                }
            )
    return out


def alpaca(rng: random.Random) -> list[dict[str, Any]]:
    rows = arithmetic(rng, 45)
    for country, capital in CAPITALS:
        rows.append(
            {"instruction": f"What is the capital of {country}?", "input": "", "output": f"{capital}."}
        )
    for word, opposite in OPPOSITES:
        rows.append({"instruction": "Give the opposite of the word.", "input": word, "output": opposite})
    for word, plural in PLURALS:
        rows.append({"instruction": "Write the plural form of the noun.", "input": word, "output": plural})
    for word in WORDS:
        rows.append({"instruction": "Reverse the letters of the word.", "input": word, "output": word[::-1]})
    for question, answer in FACTS:
        rows.append({"instruction": question, "input": "", "output": answer})
    for word in WORDS[:15]:
        vowels = sum(c in "aeiou" for c in word)
        rows.append(
            {"instruction": f'How many vowels are in the word "{word}"?', "input": "", "output": str(vowels)}
        )
    rng.shuffle(rows)
    return rows


def turn(role: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **extra}


def chat(rng: random.Random) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    pairs = list(zip(CAPITALS, CAPITALS[1:] + CAPITALS[:1], strict=True))
    for (c1, k1), (c2, k2) in pairs[:30]:
        msgs = (
            [turn("system", "You answer geography questions in one short sentence.")]
            if rng.random() < 0.4
            else []
        )
        msgs += [
            turn("user", f"What is the capital of {c1}?"),
            turn("assistant", f"The capital of {c1} is {k1}."),
            turn("user", f"And of {c2}?"),
            turn("assistant", f"The capital of {c2} is {k2}."),
        ]
        rows.append({"messages": msgs})
    for problem in arithmetic(rng, 25):
        a, b = problem["input"].split(" and ") if problem["input"] else (None, None)
        question = problem["instruction"] if a is None else f"{problem['instruction']} {a} and {b}."
        rows.append(
            {
                "messages": [
                    turn("system", "You are a patient maths tutor. Answer, then offer to explain."),
                    turn("user", question),
                    # The opening answer is context only: the follow-up is what we train on.
                    turn("assistant", f"{problem['output']} Would you like me to show the steps?", weight=0),
                    turn("user", "No thanks, just checking. Is that exact?"),
                    turn("assistant", "Yes, whole-number arithmetic like this is exact."),
                ]
            }
        )
    for (w1, o1), (w2, p2) in zip(OPPOSITES[:20], PLURALS[:20], strict=True):
        rows.append(
            {
                "messages": [
                    turn("user", f"Let's play a word game. What is the opposite of {w1}?"),
                    turn("assistant", f"The opposite of {w1} is {o1}."),
                    turn("user", f"Nice. Now what is the plural of {w2}?"),
                    turn("assistant", f"The plural of {w2} is {p2}."),
                    turn("user", f"Spell {w2} backwards."),
                    turn("assistant", w2[::-1]),
                ]
            }
        )
    for question, answer in FACTS[:25]:
        msgs = [turn("system", "You are a helpful assistant.")] if rng.random() < 0.3 else []
        rows.append({"messages": [*msgs, turn("user", question), turn("assistant", answer)]})
    rng.shuffle(rows)
    return rows


def preference(rng: random.Random) -> list[dict[str, Any]]:
    """Preference pairs in OpenAI's format: a question, a correct short answer (preferred) and a wrong or
    unhelpful one (non-preferred)."""
    rows: list[dict[str, Any]] = []

    def pair(question: str, good: str, bad: str, system: str | None = None) -> None:
        msgs = [turn("system", system)] if system else []
        rows.append(
            {
                "input": {"messages": [*msgs, turn("user", question)]},
                "preferred_output": [turn("assistant", good)],
                "non_preferred_output": [turn("assistant", bad)],
            }
        )

    for i, (country, capital) in enumerate(CAPITALS):
        wrong = CAPITALS[(i + 5) % len(CAPITALS)][1]
        system = "You answer geography questions in one short sentence." if rng.random() < 0.3 else None
        pair(f"What is the capital of {country}?", f"The capital of {country} is {capital}.",
             f"The capital of {country} is {wrong}.", system)  # fmt: skip
    for i, (word, opposite) in enumerate(OPPOSITES):
        wrong = OPPOSITES[(i + 3) % len(OPPOSITES)][1]
        pair(f"What is the opposite of {word}?", f"The opposite of {word} is {opposite}.",
             f"The opposite of {word} is {wrong}.")  # fmt: skip
    for word, plural in PLURALS:
        pair(f"What is the plural of {word}?", f"The plural of {word} is {plural}.",
             "I would rather not say.")  # fmt: skip
    for question, answer in FACTS[:20]:
        pair(question, answer, "I don't know, look it up yourself.")
    rng.shuffle(rows)
    return rows


def reinforcement(rng: random.Random) -> list[dict[str, Any]]:
    """Reinforcement prompts (OpenAI's RFT rows): a question ending in a user turn, and the reference
    answer the grader reads as item.answer (docs/training.md "Reinforcement fine-tuning")."""
    rows: list[dict[str, Any]] = []
    for country, capital in CAPITALS:
        rows.append({"q": f"What is the capital of {country}? Answer with the city only.", "answer": capital})
    for word, opposite in OPPOSITES:
        rows.append({"q": f"Give the opposite of '{word}'. One word.", "answer": opposite})
    rng.shuffle(rows)
    return [{"messages": [turn("user", r["q"])], "answer": r["answer"]} for r in rows]


TOY_WORDS = ["yes", "no", "cat", "dog", "sun"]
TOY_HEADS = [
    "Reply with the word {w}.",
    "Say {w}.",
    "Answer: {w}",
    "Write {w} and stop.",
    "The word is {w}. Repeat it.",
]
TOY_TAILS = ["", " Thanks!", " Only one word.", " Be brief."]


def toy_words(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The reinforcement toy (examples/rft_toy.py): 100 prompts asking for one of five words. The SFT
    file teaches the answer's form with a random word of the five (so the tuned model answers a word,
    the right one a fifth of the time); reinforcement with an exact-match grader then teaches which."""
    prompts = [(h.format(w=w) + t, w) for h in TOY_HEADS for t in TOY_TAILS for w in TOY_WORDS]
    sft = [
        {"messages": [turn("user", q), turn("assistant", rng.choice(TOY_WORDS))]}
        for q, _ in prompts
        for _ in range(2)
    ]
    rft = [{"messages": [turn("user", q)], "answer": w} for q, w in prompts]
    return sft, rft


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} examples to {path}")


def main() -> None:
    write(HERE / "alpaca_small.jsonl", alpaca(random.Random(7)))
    write(HERE / "chat_small.jsonl", chat(random.Random(11)))
    write(HERE / "preference_small.jsonl", preference(random.Random(13)))
    write(HERE / "rft_small.jsonl", reinforcement(random.Random(17)))
    toy_sft, toy_rft = toy_words(random.Random(0))
    write(HERE / "toy_words_sft.jsonl", toy_sft)
    write(HERE / "toy_words_rft.jsonl", toy_rft)


if __name__ == "__main__":
    main()
