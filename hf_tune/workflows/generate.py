"""``hf-tune generate``: a run's answers to a JSONL file of prompts, in batches, with a progress bar.

Each input line holds ``messages`` (a conversation, answered as its next assistant turn) or ``prompt`` (one user
turn). Answers are greedy unless a temperature is given, so they equal ``hf-tune chat``'s. Prompts are left-padded
into batches; every answered line is flushed to ``OUT.partial`` at once and a rerun continues after the last one, so
a crash loses at most one batch. The file is renamed to ``OUT`` once every prompt is answered. Only the same job is
continued: ``OUT`` may not be the input, and an existing ``OUT`` that is not this input's answers (another job's, a
user's file) is refused before anything is read or written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from hf_tune.errors import HfTuneError
from hf_tune.runtime.output_paths import Output, check_output


def read_prompts(path: str | Path) -> list[dict]:
    """The input lines, each checked to hold ``messages`` (a list of role/content turns) or ``prompt`` (a string)."""
    path = Path(path)
    if not path.is_file():
        raise HfTuneError(f"--input {path}: no such file\n  fix: a JSONL file, one {{\"prompt\": ...}} or "
                          "{\"messages\": [...]} per line")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise HfTuneError(f"--input {path}, line {number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict) or not (isinstance(row.get("prompt"), str)
                                             or _is_conversation(row.get("messages"))):
            raise HfTuneError(f"--input {path}, line {number}: needs \"prompt\" (a string) or \"messages\" (a list of "
                              "{\"role\", \"content\"} turns)")
        rows.append(row)
    if not rows:
        raise HfTuneError(f"--input {path}: no prompts in it")
    return rows


def _is_conversation(messages) -> bool:
    return isinstance(messages, list) and bool(messages) and all(
        isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)
        for turn in messages)


def conversation(row: dict) -> list[dict]:
    return row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]


@torch.no_grad()
def answer_batch(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0) -> list[str]:
    """The next assistant turn of each conversation, generated together from left-padded prompts."""
    texts = [tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
             for messages in conversations]
    if tokenizer.pad_token is None:  # a base that never padded: its end-of-sequence token pads (masked out)
        tokenizer.pad_token = tokenizer.eos_token
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    finally:
        tokenizer.padding_side = side
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else \
        {"do_sample": False}
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, **sampling)
    width = inputs["input_ids"].shape[1]
    return [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in output]


def generate_file(run_dir: str | Path, input: str | Path, out: str | Path, batch_size: int = 8,
                  max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                  device: str | None = None, dtype: str | None = None) -> dict:
    """Answer every prompt of ``input`` into ``out`` (JSONL: the input line plus ``answer``)."""
    from tqdm.auto import tqdm

    from hf_tune.workflows.inference import load_trained

    rows = read_prompts(input)
    out = check_output(out, Output("file", ours=lambda path, _: answers_input(path, input)), [input, run_dir])
    partial = out.with_name(out.name + ".partial")
    if out.is_file():  # this input's answers, complete: nothing to do, and the file is left as it is
        return {"out": str(out), "answers": len(rows), "resumed_after": len(rows)}
    done = _answered(partial, rows)
    model, tokenizer = load_trained(run_dir, device=device, dtype=dtype)
    refuse_unknown_roles(tokenizer, rows, input)  # before anything is written
    if seed is not None:
        torch.manual_seed(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    with partial.open("a", encoding="utf-8") as sink, tqdm(total=len(rows), initial=done, desc="answers",
                                                           unit="prompt") as bar:
        for start in range(done, len(rows), batch_size):
            batch = rows[start:start + batch_size]
            answers = answer_batch(model, tokenizer, [conversation(row) for row in batch], max_new_tokens,
                                   temperature, top_p)
            for row, answer in zip(batch, answers):
                sink.write(json.dumps({**row, "answer": answer}, ensure_ascii=False) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
            bar.update(len(batch))
    os.replace(partial, out)
    return {"out": str(out), "answers": len(rows), "resumed_after": done}


ROLES = ("system", "developer", "user", "assistant", "tool")  # the roles chat templates are written for


def refuse_unknown_roles(tokenizer, rows: list[dict], input: str | Path) -> None:
    """Every role of the prompts is a conversation role (``ROLES``) that the run's chat template renders (its content
    appears in the rendering), else an ``HfTuneError`` naming the first line that uses it: a role the template drops,
    refuses or (ChatML) prints whatever it is would be answered as a conversation the model was never shown."""
    verdicts: dict[str, bool] = {}

    def renders(role: str) -> bool:
        if role not in verdicts:
            marker = "hf-tune-role-check"
            try:
                text = tokenizer.apply_chat_template([{"role": role, "content": marker}], tokenize=False)
                verdicts[role] = role in ROLES and marker in text
            except Exception:  # the template raised on the role (jinja's raise_exception, a missing key)
                verdicts[role] = False
        return verdicts[role]

    for number, row in enumerate(rows, start=1):
        for turn in conversation(row):
            if not renders(turn["role"]):
                known = ", ".join(role for role in ROLES if renders(role))
                raise HfTuneError(f"--input {input}, line {number}: role {turn['role']!r} is not one the run's chat "
                                  f"template renders\n  fix: use one it does ({known})")


def answers_input(path: str | Path, input: str | Path) -> bool:
    """Whether ``path`` holds this input's answers, every prompt answered in order (what a finished ``generate``
    of it wrote): only then may a rerun leave it be. Another job's answers, or any other file, are not."""
    try:
        rows = read_prompts(input)
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        answered = [json.loads(line) for line in lines if line.strip()]
    except (HfTuneError, OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return len(answered) == len(rows) and all(
        isinstance(line, dict) and "answer" in line and {k: v for k, v in line.items() if k != "answer"} == row
        for line, row in zip(answered, rows))


def _answered(partial: Path, rows: list[dict]) -> int:
    """How many prompts an earlier, interrupted run answered (its lines must be the first inputs, in order)."""
    if not partial.is_file():
        return 0
    lines = partial.read_text(encoding="utf-8").splitlines()
    kept = []
    for line, row in zip(lines, rows):
        try:
            answered = json.loads(line)
        except json.JSONDecodeError:
            break  # the line a crash cut short
        if {key: value for key, value in answered.items() if key != "answer"} != row:
            raise HfTuneError(f"{partial}: answers another input file\n  fix: remove it, or pass the --input it "
                              "was started with")
        kept.append(line)
    partial.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    return len(kept)
