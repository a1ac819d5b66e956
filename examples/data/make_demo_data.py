"""Writes the demo datasets shipped beside this file (deterministic; rerun to regenerate them).

  chat_demo.jsonl     400 chats (messages), 1-3 user turns, some with a system message, 20-400 tokens
  alpaca_demo.jsonl    40 instruction/input/output examples (the `instruction` format)
  sharegpt_demo.jsonl  40 ShareGPT conversations (from/value)
  text_demo.jsonl     200 short plain-text paragraphs (the `text` format)
  topics_train.jsonl  320 sentences labelled sports / cooking / technology / weather (the `classification` format)
  topics_test.jsonl    80 held-out sentences of the same four topics
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "Canada": "Ottawa", "Australia": "Canberra", "Brazil": "Brasília", "Egypt": "Cairo",
    "Kenya": "Nairobi", "India": "New Delhi", "China": "Beijing", "Mexico": "Mexico City", "Peru": "Lima",
    "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw", "Greece": "Athens",
    "Turkey": "Ankara", "Argentina": "Buenos Aires", "Chile": "Santiago", "Vietnam": "Hanoi", "Thailand": "Bangkok",
    "Morocco": "Rabat", "Nigeria": "Abuja", "Ireland": "Dublin", "Austria": "Vienna", "Hungary": "Budapest",
}
ANIMALS = {
    "octopus": ("has three hearts and blue blood", "can change the colour and texture of its skin", "ocean"),
    "honeybee": ("communicates the direction of flowers with a waggle dance", "lives in colonies led by one queen", "hive"),
    "camel": ("stores fat, not water, in its hump", "can drink over 100 litres of water in minutes", "desert"),
    "penguin": ("cannot fly but swims very well", "keeps its eggs warm on its feet in some species", "southern hemisphere"),
    "elephant": ("is the largest living land animal", "uses its trunk to breathe, smell, drink and grab", "savanna and forest"),
    "owl": ("can turn its head about 270 degrees", "hunts mostly at night with silent flight", "forest"),
    "salmon": ("returns to the river where it hatched to spawn", "lives in both fresh and salt water", "rivers and ocean"),
    "bat": ("is the only mammal capable of true flight", "uses echolocation to find insects", "caves and forests"),
    "giraffe": ("is the tallest living animal", "has the same number of neck bones as a human: seven", "savanna"),
    "ant": ("can carry many times its own body weight", "follows scent trails laid by other ants", "colonies"),
}
WORDS = ["garden", "planet", "rocket", "silver", "window", "pencil", "forest", "harbor", "lantern", "meadow",
         "python", "violin", "marble", "thunder", "compass", "blanket", "canyon", "pepper", "orbit", "puzzle"]
SYSTEMS = ["You are a concise assistant.", "Answer briefly and precisely.", "You are a friendly tutor."]


def arithmetic(rng):
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    name = {"+": "sum", "-": "difference", "*": "product"}[op]
    turns = [(f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}.")]
    if rng.random() < 0.4:
        turns.append(("And if you double that?", f"Doubling {value} gives {2 * value}."))
    if rng.random() < 0.2:
        turns.append((f"Is the {name} even or odd?", f"{value} is {'even' if value % 2 == 0 else 'odd'}."))
    return turns


def capital(rng):
    country = rng.choice(sorted(CAPITALS))
    turns = [(rng.choice(["What is the capital of {}?", "Which city is the capital of {}?", "Name the capital of {}."]).format(country),
              f"The capital of {country} is {CAPITALS[country]}.")]
    if rng.random() < 0.35:
        other = rng.choice(sorted(set(CAPITALS) - {country}))
        turns.append((f"And of {other}?", f"The capital of {other} is {CAPITALS[other]}."))
    return turns


def temperature(rng):
    c = rng.randint(-30, 45)
    f = c * 9 / 5 + 32
    return [(f"Convert {c} degrees Celsius to Fahrenheit.",
             f"{c} °C is {f:g} °F (multiply by 9/5, then add 32: {c} × 9/5 + 32 = {f:g}).")]


def distance(rng):
    km = rng.randint(1, 500)
    return [(f"How many miles is {km} km?", f"{km} km is about {km * 0.621371:.1f} miles (1 km ≈ 0.621371 miles).")]


def word_task(rng):
    word = rng.choice(WORDS)
    kind = rng.randrange(4)
    if kind == 0:
        return [(f"Spell '{word}' backwards.", f"'{word}' backwards is '{word[::-1]}'.")]
    if kind == 1:
        return [(f"How many letters are in the word '{word}'?", f"'{word}' has {len(word)} letters.")]
    if kind == 2:
        return [(f"Write '{word}' in capital letters.", word.upper())]
    letter = rng.choice(word)
    return [(f"How many times does the letter '{letter}' appear in '{word}'?",
             f"The letter '{letter}' appears {word.count(letter)} time{'s' if word.count(letter) > 1 else ''} in '{word}'.")]


def sorting(rng):
    numbers = rng.sample(range(1, 100), rng.randint(4, 9))
    order = rng.choice(["ascending", "descending"])
    result = sorted(numbers, reverse=order == "descending")
    turns = [(f"Sort these numbers in {order} order: {', '.join(map(str, numbers))}.", ", ".join(map(str, result)))]
    if rng.random() < 0.4:
        turns.append(("What is the largest one?", f"The largest number is {max(numbers)}."))
    return turns


def animal(rng):
    name = rng.choice(sorted(ANIMALS))
    fact1, fact2, habitat = ANIMALS[name]
    if rng.random() < 0.5:
        return [(f"Tell me an interesting fact about the {name}.", f"The {name} {fact1}.")]
    return [(f"Write a short description of the {name}.",
             f"The {name} is a remarkable animal found in {habitat} habitats. It {fact1}, and it {fact2}. "
             f"These traits help the {name} survive and make it a favourite subject of nature documentaries.")]


def listing(rng):
    kind = rng.randrange(3)
    if kind == 0:
        n = rng.randint(3, 7)
        days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
        return [(f"List the first {n} days of the week.", "\n".join(f"{i + 1}. {d}" for i, d in enumerate(days[:n])))]
    if kind == 1:
        n = rng.randint(2, 12)
        return [(f"Show the multiplication table of {n} up to 10.", "\n".join(f"{n} × {i} = {n * i}" for i in range(1, 11)))]
    countries = rng.sample(sorted(CAPITALS), rng.randint(3, 6))
    return [(f"Give me the capitals of {', '.join(countries[:-1])} and {countries[-1]}.",
             "\n".join(f"- {c}: {CAPITALS[c]}" for c in countries))]


TOPICS = {
    "sports": (["the striker", "our goalkeeper", "the coach", "the home team", "the tennis player", "the sprinter",
                "the referee", "the captain"],
               ["scored twice in the second half", "missed a penalty", "won the championship", "broke the record",
                "trained hard before the final", "was substituted after an injury", "celebrated the victory",
                "lost the match on penalties"],
               ["at the stadium", "in the league", "during the tournament", "before kick-off"]),
    "cooking": (["the chef", "my grandmother", "the baker", "our neighbour", "the cook", "the pastry chef",
                 "my brother", "the restaurant"],
                ["simmered the sauce for an hour", "baked fresh bread", "chopped the onions finely",
                 "seasoned the soup with pepper", "roasted the vegetables", "whisked the eggs and sugar",
                 "served a spicy curry", "fried the fish in butter"],
                ["in the kitchen", "for dinner", "in the oven", "with fresh herbs"]),
    "technology": (["the engineer", "the startup", "the developer", "our team", "the company", "the researcher",
                    "the new laptop", "the software update"],
                   ["released a faster processor", "fixed a bug in the app", "deployed the server to the cloud",
                    "trained a neural network", "launched a new smartphone", "improved the battery life",
                    "patched a security flaw", "wrote the code in Python"],
                   ["last week", "for the users", "in the data centre", "with better encryption"]),
    "weather": (["the forecast", "the storm", "the morning", "the weekend", "the wind", "the afternoon",
                 "the sky", "the coast"],
                ["brought heavy rain", "turned cold and foggy", "was sunny and warm", "brought snow to the hills",
                 "cleared after the thunder", "was humid with a light drizzle", "had strong gusts",
                 "stayed dry and bright"],
                ["across the region", "near the mountains", "according to the meteorologist", "all day"]),
}


def topic_sentence(rng, topic: str) -> str:
    subjects, verbs, tails = TOPICS[topic]
    sentence = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(tails)}"
    opener = rng.choice(["", "Yesterday ", "I heard that ", "Apparently ", "Once again ", "This time "])
    text = opener + sentence if opener else sentence
    return text[0].upper() + text[1:] + "."


TASKS = [arithmetic, capital, temperature, distance, word_task, sorting, animal, listing]


def chat(rng) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.25 else []
    for user, assistant in rng.choice(TASKS)(rng):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return messages


def write_jsonl(name: str, rows: list[dict]) -> None:
    with open(HERE / name, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    rng = random.Random(1234)
    write_jsonl("chat_demo.jsonl", [{"messages": chat(rng)} for _ in range(400)])
    alpaca = []
    for _ in range(40):
        m = [t for t in chat(rng) if t["role"] != "system"]
        if rng.random() < 0.5:
            alpaca.append({"instruction": m[0]["content"], "input": "", "output": m[1]["content"]})
        else:
            alpaca.append({"instruction": "Answer the question.", "input": m[0]["content"], "output": m[1]["content"]})
    write_jsonl("alpaca_demo.jsonl", alpaca)
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    write_jsonl("sharegpt_demo.jsonl", [{"conversations": [{"from": roles[t["role"]], "value": t["content"]} for t in chat(rng)]}
                                        for _ in range(40)])
    texts = []
    for _ in range(200):
        name = rng.choice(sorted(ANIMALS))
        fact1, fact2, habitat = ANIMALS[name]
        country = rng.choice(sorted(CAPITALS))
        texts.append({"text": rng.choice([
            f"The {name} {fact1}. It also {fact2}, and it is usually found in {habitat} habitats.",
            f"{CAPITALS[country]} is the capital of {country}. Many travellers visit {CAPITALS[country]} every year.",
            f"A well-known fact: the {name} {fact2}. Scientists study the {name} in {habitat} habitats.",
        ])})
    write_jsonl("text_demo.jsonl", texts)
    topics = [{"text": topic_sentence(rng, t), "label": t} for _ in range(100) for t in sorted(TOPICS)]
    rng.shuffle(topics)
    write_jsonl("topics_train.jsonl", topics[:320])
    write_jsonl("topics_test.jsonl", topics[320:])


if __name__ == "__main__":
    main()
