"""Writes the demo data of the preference and RL methods, from the shipped chats (deterministic; rerun to regenerate).

  preference_demo.jsonl            240 pairs (TRL's conversational preference layout): a chat's first question, its
                                   correct answer chosen, a wrong one rejected (a number changed, another capital, or
                                   another question's answer)
  preference_llamafactory_demo.json 40 of the same pairs in LLaMA-Factory's layout (ShareGPT conversations with
                                   chosen / rejected messages), to show that layout reads too
  arithmetic_prompts.jsonl         64 prompts "What is a + b?" with an `answer` column, for method grpo
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

HERE = Path(__file__).parent
CAPITAL = re.compile(r"The capital of (?P<country>[A-Z][\w ]+) is (?P<city>[^.]+)\.")
NUMBER = re.compile(r"-?\d+")


def wrong_answer(answer: str, others: list[str], capitals: list[str], rng: random.Random) -> str:
    """A plausible but wrong answer: another capital, the last number changed, or another question's answer."""
    found = CAPITAL.search(answer)
    if found:
        city = rng.choice([c for c in capitals if c != found["city"]])
        return answer.replace(found["city"], city)
    numbers = list(NUMBER.finditer(answer))
    if numbers:
        last = numbers[-1]
        value = int(last.group()) + rng.choice([-10, -2, -1, 1, 2, 10])
        return answer[:last.start()] + str(value) + answer[last.end():]
    return rng.choice([o for o in others if o != answer])


def main() -> None:
    rng = random.Random(7)
    chats = [json.loads(line)["messages"] for line in (HERE / "chat_demo.jsonl").read_text().splitlines()]
    firsts = []
    for messages in chats:
        system = [m for m in messages[:1] if m["role"] == "system"]
        user, assistant = messages[len(system)], messages[len(system) + 1]
        firsts.append((system + [user], assistant["content"]))
    answers = [a for _, a in firsts]
    capitals = sorted({m["city"] for a in answers for m in CAPITAL.finditer(a)})
    pairs = []
    for prompt, answer in firsts[:240]:
        rejected = wrong_answer(answer, answers, capitals, rng)
        pairs.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": answer}],
                      "rejected": [{"role": "assistant", "content": rejected}]})
    with open(HERE / "preference_demo.jsonl", "w") as f:
        f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs)

    sharegpt = {"user": "human", "assistant": "gpt"}
    factory = []
    for pair in pairs[:40]:
        system = [m["content"] for m in pair["prompt"] if m["role"] == "system"]
        row = {"conversations": [{"from": sharegpt[m["role"]], "value": m["content"]} for m in pair["prompt"]
                                 if m["role"] != "system"],
               "chosen": {"from": "gpt", "value": pair["chosen"][0]["content"]},
               "rejected": {"from": "gpt", "value": pair["rejected"][0]["content"]}}
        factory.append({**row, "system": system[0]} if system else row)
    (HERE / "preference_llamafactory_demo.json").write_text(json.dumps(factory, ensure_ascii=False, indent=1) + "\n")

    with open(HERE / "arithmetic_prompts.jsonl", "w") as f:
        for _ in range(64):
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            prompt = [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}]
            f.write(json.dumps({"prompt": prompt, "answer": str(a + b)}) + "\n")


if __name__ == "__main__":
    main()
