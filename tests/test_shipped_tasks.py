"""hf_tune's shipped lm-eval tasks (hf_tune/evaluation/tasks/): hf_tune_chat_skills asks only what the demo chats
never ask, each right answer is recomputed here from the question, and evaluation.apply_chat_template reaches
lm-eval (the score equals lm-eval's own simple_evaluate with the chat template, loading the model itself)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hf_tune.recipe.evaluation_tasks import SHIPPED_TASKS_DIR, shipped_tasks

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "data" / "chat_demo.jsonl"
SKILLS = [json.loads(line) for line in (SHIPPED_TASKS_DIR / "hf_tune_chat_skills.jsonl").read_text().splitlines()]


def demo_user_turns() -> list[str]:
    return [m["content"] for line in DEMO.read_text().splitlines()
            for m in json.loads(line)["messages"] if m["role"] == "user"]


def test_chat_skills_is_shipped_with_distinct_questions_and_four_choices():
    assert "hf_tune_chat_skills" in shipped_tasks()
    assert len({row["question"] for row in SKILLS}) == len(SKILLS) >= 40
    for row in SKILLS:
        assert len(set(row["choices"])) == 4 and 0 <= row["answer"] < 4


def test_no_question_of_chat_skills_is_asked_in_the_demo_chats():
    demo_text, asked = DEMO.read_text(), set(demo_user_turns())
    for row in SKILLS:
        assert row["question"] not in asked
        subject = re.search(r"capital of ([A-Z][A-Za-z ]+)[.?]|Convert (-?\d+) degrees|is (\d+) km|'([a-z]+)'",
                            row["question"])
        assert subject, row["question"]
        country, celsius, km, word = subject.groups()
        if country:
            assert country not in demo_text
        elif celsius:
            assert f"Convert {celsius} degrees" not in demo_text
        elif km:
            assert f"How many miles is {km} km" not in demo_text
        else:
            assert f"'{word}'" not in demo_text and word.upper() not in demo_text


def right_answer(question: str) -> str | None:
    """The demo's answer to a question of its kinds, computed from the question (None: capitals, a fact)."""
    def number(x: float) -> str:
        x = round(x, 1)
        return str(int(x)) if x == int(x) else str(x)

    if m := re.fullmatch(r"Convert (-?\d+) degrees Celsius to Fahrenheit\.", question):
        c = int(m[1])
        f = number(c * 1.8 + 32)
        return f"{c} °C is {f} °F (multiply by 9/5, then add 32: {c} × 9/5 + 32 = {f})."
    if m := re.fullmatch(r"How many miles is (\d+) km\?", question):
        return f"{m[1]} km is about {number(int(m[1]) / 1.609344)} miles (1 km ≈ 0.621371 miles)."
    if m := re.fullmatch(r"Spell '([a-z]+)' backwards\.", question):
        return f"'{m[1]}' backwards is '{''.join(reversed(m[1]))}'."
    if m := re.fullmatch(r"Write '([a-z]+)' in capital letters\.", question):
        return m[1].upper()
    assert re.fullmatch(r"(Name the capital of [A-Za-z ]+\.|Which city is the capital of [A-Za-z ]+\?)", question)
    return None


def test_each_right_answer_is_the_one_computed_from_its_question_in_the_demos_style():
    kinds = set()
    for row in SKILLS:
        expected = right_answer(row["question"])
        kinds.add(row["question"].split()[0])
        if expected is None:  # a capital: the demo's sentence about the asked country
            country = re.search(r"capital of ([A-Za-z ]+)[.?]", row["question"])[1]
            assert all(c.startswith(f"The capital of {country} is ") for c in row["choices"])
        else:
            assert row["choices"][row["answer"]] == expected
            assert row["choices"].count(expected) == 1
    assert kinds == {"Name", "Which", "Convert", "How", "Spell", "Write"}  # the demo's five kinds (two of capitals)


def test_apply_chat_template_scores_like_lm_evals_own_simple_evaluate_with_the_template(tiny_llama_dir):
    """evaluation.apply_chat_template reaches lm-eval: hf_tune's harness on the model in memory equals lm-eval's
    simple_evaluate loading the model itself with apply_chat_template (whose prompts are the chat template's)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from hf_tune.evaluation.harness import Harness
    from hf_tune.workflows.evaluate import _load_named

    model, tokenizer = _load_named(tiny_llama_dir, "cpu", "float32")
    chat = Harness(["hf_tune_chat_skills"], limit=8, batch_size=4, apply_chat_template=True).score(model, tokenizer)
    plain = Harness(["hf_tune_chat_skills"], limit=8, batch_size=4).score(model, tokenizer)
    reference = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tiny_llama_dir},dtype=float32", device="cpu",
        tasks=["hf_tune_chat_skills"], limit=8, batch_size=4, bootstrap_iters=0, apply_chat_template=True,
        log_samples=True, task_manager=TaskManager(include_path=str(SHIPPED_TASKS_DIR), include_defaults=False))
    for metric in ("acc", "acc_norm"):
        assert chat[f"hf_tune_chat_skills_{metric}"] == pytest.approx(
            reference["results"]["hf_tune_chat_skills"][f"{metric},none"])
    assert "<|im_start|>user" in reference["samples"]["hf_tune_chat_skills"][0]["arguments"][0][0]
    assert set(chat) == set(plain) == {"hf_tune_chat_skills_acc", "hf_tune_chat_skills_acc_norm"}
