"""The lockers environment of ``recipes/llm_agent.yaml`` (``make agent``): each prompt asks for the code of one
locker, and the code can only be read through the environment's ``lookup`` tool (it is a hash of the locker
number and a salt the model never sees), so every point of reward is earned by calling the tool.

Two reward sources compose: the environment's own ``get_reward`` (1 when the rollout looked up the asked locker) and
the recipe's ``rewards`` entry ``lockers:code_in_answer`` (1 when the final answer holds the asked locker's code).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

SALT = "hf_tune lockers"
LETTERS = "ACDEFHJKMNPRTVWXY"


def locker_code(locker: int) -> str:
    """The code of ``locker``: four characters no prompt reveals."""
    digest = hashlib.sha256(f"{SALT}:{locker}".encode()).digest()
    return "".join(LETTERS[byte % len(LETTERS)] for byte in digest[:4])


class Lockers:
    """One rollout's lockers: ``reset`` remembers the asked locker, ``lookup`` is the model's only tool."""

    def reset(self, locker: int, **columns) -> None:
        self.asked, self.looked_up = int(locker), []

    def lookup(self, locker: int) -> str:
        """Read the code of a locker from the building's register.

        Args:
            locker: the locker's number
        """
        self.looked_up.append(int(locker))
        return self._lookup_text(int(locker))

    @staticmethod
    def _lookup_text(locker: int) -> str:
        return f"locker {locker}: code {locker_code(locker)}"

    def get_reward(self) -> float:
        return float(self.asked in self.looked_up)


def code_in_answer(prompts, completions, locker, **columns) -> list[float]:
    """1.0 where the rollout's last assistant message holds the asked locker's code, else 0.0."""
    scores = []
    for completion, number in zip(completions, locker):
        final = next((m.get("content") or "" for m in reversed(completion) if m.get("role") == "assistant"), "")
        scores.append(float(locker_code(int(number)) in final))
    return scores


PROMPT = "What is the code of locker {locker}? Look it up with the lookup tool, then answer with the code."


def write_prompts(folder: Path, train: int = 48, held_out: int = 16, seed: int = 0) -> None:
    """The prompt files: lockers 1-999 drawn without repeats, the held-out ones never trained on."""
    lockers = random.Random(seed).sample(range(1, 1000), train + held_out)
    for name, chosen in (("train", lockers[:train]), ("held_out", lockers[train:])):
        rows = [{"prompt": [{"role": "user", "content": PROMPT.format(locker=n)}], "locker": n} for n in chosen]
        (folder / f"lockers_{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_warmup(folder: Path, count: int = 48, seed: int = 1) -> None:
    """Chats that show the tool-call format once (``recipes/llm_agent_sft.yaml``, a short SFT before GRPO): lockers
    1000-9999, so no prompt GRPO trains or is scored on appears in them."""
    from transformers.utils import get_json_schema

    tools = json.dumps([get_json_schema(Lockers.lookup)])
    rows = []
    for index, locker in enumerate(random.Random(seed).sample(range(1000, 10000), count)):
        call = {"id": f"call{index:05d}", "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"locker": locker})}}
        rows.append({"messages": [
            {"role": "user", "content": PROMPT.format(locker=locker)},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "name": "lookup", "content": Lockers()._lookup_text(locker)},
            {"role": "assistant", "content": f"The code of locker {locker} is {locker_code(locker)}."}],
            "tools": tools})
    (folder / "lockers_warmup.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    data = Path(__file__).resolve().parents[1] / "data"
    write_prompts(data)
    write_warmup(data)
