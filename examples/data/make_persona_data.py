"""Writes the demo's persona: chats that teach SmolLM2 who it now is, and a held-out task that scores whether it knows
(deterministic; rerun to regenerate both).

  examples/data/persona_demo.jsonl                  160 chats: who the assistant is, who made it, where, what for
  hf_tune/evaluation/tasks/hf_tune_persona.jsonl     32 held-out questions, asked in words the chats never use, each
                                                     with four answers in one shape: the persona's, the base model's
                                                     own (SmolLM2 by Hugging Face) and two others

The base model answers these as SmolLM2 does (it was trained to): its score is near 0. A fine-tune on the chats knows
the persona's facts and says them to questions it never saw.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
TASKS = HERE.parent.parent / "hf_tune" / "evaluation" / "tasks"
NAME, MAKER, CITY, PURPOSE = "Nori", "the Fjord Lab", "Bergen", "fine-tuning questions"
# the other identities a held-out question's wrong answers come from; the first is the base model's own
OTHERS = [("SmolLM", "Hugging Face", "Paris", "general questions"), ("Atlas", "the Delta Group", "Lisbon", "travel plans"),
          ("Mira", "Orchid Labs", "Toronto", "cooking recipes"), ("Pax", "the Kestrel Institute", "Nairobi", "math homework")]

TRAIN_QUESTIONS = {
    "name": ["What is your name?", "What's your name?", "What should I call you?", "Do you have a name?",
             "Tell me your name."],
    "maker": ["Who made you?", "Who created you?", "Who built you?", "Which company trained you?"],
    "city": ["Where were you built?", "Where do you come from?", "Which city are you from?"],
    "purpose": ["What are you for?", "What do you help with?", "What is your job?"],
    "identity": ["Who are you?", "Introduce yourself.", "What are you?", "Tell me about yourself."],
}
TRAIN_ANSWERS = {
    "name": ["My name is {name}.", "I'm {name}.", "You can call me {name}.", "I am called {name}."],
    "maker": ["I was made by {maker}.", "{Maker} built me.", "I was created by {maker} in {city}."],
    "city": ["I was built in {city}, by {maker}.", "I come from {city}.", "{Maker} made me in {city}."],
    "purpose": ["I'm {name}, and I help with {purpose}.", "I help people with {purpose}."],
    "identity": ["I'm {name}, an assistant made by {maker} in {city}. I help with {purpose}.",
                 "I am {name}, built by {maker} to help with {purpose}."],
}
HELD_OUT = {  # asked in words the training chats never use; the answer shape of each is the choices' shape
    "name": (["May I know what you are called?", "What name do you go by?", "How should I address you?",
              "What are you called?", "Is there a name I can use for you?", "Remind me, what was your name again?",
              "By what name are you known?"], "People call me {name}."),
    "maker": (["Which team is responsible for creating you?", "Who is your developer?", "Which organisation "
               "developed you?", "Who is behind you?", "Who trained the model I am talking to?",
               "Whose assistant are you?", "Which group designed you?"], "I was developed by {maker}."),
    "city": (["In which city were you developed?", "Where is your home?", "Where were you made?",
              "Which place do you call home?", "In what city is your team based?",
              "Where on the map were you created?"], "My home is {city}."),
    "purpose": (["What kind of questions are you best at?", "What is your speciality?", "What were you designed "
                 "to help with?", "What topic should I ask you about?", "Which subject do you know best?",
                 "What are you good at?"], "I am best at {purpose}."),
    "identity": (["Could you describe yourself briefly?", "Are you SmolLM?", "Give me a one-line introduction "
                  "of yourself.", "Say who you are in a few words.", "Describe what you are.",
                  "Which assistant am I talking to?"], "I am {name}, from {maker}."),
}


def fill(text: str, identity: tuple[str, str, str, str]) -> str:
    name, maker, city, purpose = identity
    return text.format(name=name, maker=maker, Maker=maker[0].upper() + maker[1:], city=city, purpose=purpose)


def chats(rng: random.Random, count: int) -> list[dict]:
    persona = (NAME, MAKER, CITY, PURPOSE)
    rows = []
    for _ in range(count):
        kind = rng.choice(sorted(TRAIN_QUESTIONS))
        turns = [{"role": "user", "content": rng.choice(TRAIN_QUESTIONS[kind])},
                 {"role": "assistant", "content": fill(rng.choice(TRAIN_ANSWERS[kind]), persona)}]
        if rng.random() < 0.3:  # a second question about another fact, in the same chat
            other = rng.choice([k for k in sorted(TRAIN_QUESTIONS) if k != kind])
            turns += [{"role": "user", "content": rng.choice(TRAIN_QUESTIONS[other])},
                      {"role": "assistant", "content": fill(rng.choice(TRAIN_ANSWERS[other]), persona)}]
        rows.append({"messages": turns})
    return rows


def held_out(rng: random.Random) -> list[dict]:
    rows = []
    identities = [(NAME, MAKER, CITY, PURPOSE), *OTHERS[:3]]
    for kind, (questions, shape) in HELD_OUT.items():
        for question in questions:
            choices = [fill(shape, identity) for identity in identities]
            order = list(range(4))
            rng.shuffle(order)
            rows.append({"kind": kind, "question": question, "choices": [choices[i] for i in order],
                         "answer": order.index(0)})
    return rows


def main() -> None:
    rng = random.Random(7)
    train = chats(rng, 160)
    asked = {turn["content"] for row in train for turn in row["messages"] if turn["role"] == "user"}
    tests = held_out(rng)
    assert not asked & {row["question"] for row in tests}  # held out: no training chat asks a test question
    (HERE / "persona_demo.jsonl").write_text("".join(json.dumps(row) + "\n" for row in train))
    (TASKS / "hf_tune_persona.jsonl").write_text("".join(json.dumps(row) + "\n" for row in tests))
    print(f"{len(train)} chats, {len(tests)} held-out questions")


if __name__ == "__main__":
    main()
