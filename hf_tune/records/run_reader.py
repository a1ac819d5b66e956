"""The one reader of a run folder (``training.output_dir``) for every verb that opens one: ``chat``, ``merge``,
``push``, ``register``, ``report``, ``compare``, ``eval``. ``open_run`` checks what the verb needs before any model
loads; a file that is missing, truncated or not what it should be is one ``HfTuneError`` naming the file, what is
wrong with it, and how to recover (most often: the newest complete checkpoint, which holds its own copy)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_tune import run_folder
from hf_tune.catalog.tasks import DEFAULT_TASK, task_of
from hf_tune.errors import HfTuneError
from hf_tune.model.embedded import embedded_model_path, is_embedded
from hf_tune.run_folder import last_complete_checkpoint

ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
MODEL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
TOKENIZER = ("tokenizer_config.json", "preprocessor_config.json", "processor_config.json")  # or an image processor
NEEDS = ("manifest", "recipe", "trainer_state", "adapter", "weights", "tokenizer")  # what a verb can ask for


@dataclass
class RunFolder:
    """A run folder opened for reading: each file parsed once, on first use, checked as it is read."""

    path: Path
    _parsed: dict[str, Any] = field(default_factory=dict, repr=False)

    def has(self, name: str) -> bool:
        return (self.path / name).is_file()

    def json(self, name: str, required: bool = True) -> Any:
        """The JSON file ``name`` of the folder (None where it is absent and not ``required``)."""
        return self._read(name, required, _parse_json)

    def jsonl(self, name: str) -> list[dict]:
        """The lines of a JSON-lines file the run appends to (``eval_scores.jsonl``, ``samples.jsonl``); [] where
        it is absent. A line cut short by a crash while it was written is named by its number."""
        if not self.has(name):
            return []
        rows = []
        for number, line in enumerate((self.path / name).read_text(encoding="utf-8").splitlines(), 1):
            try:
                row = json.loads(line) if line.strip() else None
            except ValueError as err:
                raise self._corrupt(name, f"line {number}: {str(err).splitlines()[0]}") from None
            if row is not None and not isinstance(row, dict):
                raise self._corrupt(name, f"line {number} holds a {type(row).__name__}, not an object")
            rows += [row] if row is not None else []
        return rows

    def manifest(self, required: bool = True) -> dict:
        """``run.json``: what the run was and how it ended ({} where it is absent and not ``required``)."""
        return self._mapping(run_folder.MANIFEST, required)

    def recipe(self, required: bool = True) -> dict:
        """The resolved recipe: ``recipe.yaml``, else the copy in ``run.json``."""
        if not self.has(run_folder.RECIPE) and self.has(run_folder.MANIFEST):
            recipe = self.manifest().get("recipe")
            if isinstance(recipe, dict):
                return recipe
        return self._mapping(run_folder.RECIPE, required)

    def trainer_state(self, required: bool = True) -> dict:
        """``trainer_state.json`` of a finished run, else of the newest complete checkpoint (a run in progress); {}
        where there is neither and it is not ``required``."""
        if self.has(run_folder.TRAINER_STATE):
            state = self._mapping(run_folder.TRAINER_STATE, True)
        else:
            checkpoint = last_complete_checkpoint(self.path)
            if checkpoint is None and not required:
                return {}
            if checkpoint is None:
                raise HfTuneError(f"{self.path}: no trainer_state.json, and no complete checkpoint yet\n  fix: pass "
                                  "the output_dir of a run (a run in progress is read from its newest checkpoint)")
            state = RunFolder(checkpoint)._mapping(run_folder.TRAINER_STATE, True)
        if not isinstance(state.get("log_history"), list):
            raise self._corrupt(run_folder.TRAINER_STATE, "it has no log_history list")
        return state

    def adapter_config(self) -> dict | None:
        """``adapter_config.json`` of a LoRA run (None for a full fine-tune)."""
        if not self.has(run_folder.ADAPTER_CONFIG):
            return None
        config = self._mapping(run_folder.ADAPTER_CONFIG, True)
        if not config.get("base_model_name_or_path"):
            raise self._corrupt(run_folder.ADAPTER_CONFIG, "it names no base_model_name_or_path")
        return config

    def adapter_base(self) -> tuple[str, str | None]:
        """(what loads the adapter's base, its revision): the name ``adapter_config.json`` gives, a Hub id or a
        path, with an ``embedded:NAME`` resolved to this machine's copy (made from its package on first use)."""
        config = self.adapter_config()
        if config is None:
            raise HfTuneError(f"{self.path}: no {run_folder.ADAPTER_CONFIG}: a full fine-tune has no base to load")
        name = config["base_model_name_or_path"]

        return (embedded_model_path(name), None) if is_embedded(name) else (name, config.get("revision"))

    def weights(self) -> str:
        """"adapter" or "model": what the folder holds, its weight files checked to be there."""
        if self.adapter_config() is not None:
            self._require_one(ADAPTER_WEIGHTS, "the LoRA adapter's weights are")
            self._whole_safetensors("adapter_model*.safetensors")
            return "adapter"
        if self.has(run_folder.MODEL_CONFIG):
            self._mapping(run_folder.MODEL_CONFIG, True)
            self._require_one(MODEL_WEIGHTS, "the model's weights are")
            self._whole_safetensors("model*.safetensors")
            return "model"
        raise HfTuneError(f"{self.path}: no trained weights here (neither {run_folder.ADAPTER_CONFIG} nor "
                          f"{run_folder.MODEL_CONFIG})\n  fix: {self._recovery('a finished run folder')}")

    def task(self) -> str:
        """The run's ``model.task`` (the default task for a folder without a recipe: a bare model folder)."""

        return (self.recipe(required=False).get("model") or {}).get("task") or DEFAULT_TASK

    def require_causal_lm(self, verb: str) -> RunFolder:
        """This run, if its ``model.task`` is a causal LM; else an error saying what ``verb`` does ("serve answers
        with")."""
        if self.task() != "causal_lm":
            raise HfTuneError(f"{self.path}: a {self.task()} run (its recipe's model.task), and {verb} a causal LM"
                              "\n  fix: pass a run whose model.task is causal_lm (a classifier or reward model is "
                              "scored by evaluation.metrics and hf-tune compare)")
        return self

    def check(self, needs: Iterable[str]) -> RunFolder:
        for need in needs:
            if need == "tokenizer":
                self._require_one(TOKENIZER, "the tokenizer (or processor) files are")
            elif need == "adapter":
                if self.adapter_config() is None:
                    raise HfTuneError(f"{self.path}: no {run_folder.ADAPTER_CONFIG}: only a LoRA run has an adapter"
                                      "\n  fix: a full fine-tune is already a whole model: use the folder as is")
                self.weights()
            else:
                getattr(self, need)()
        return self

    def _read(self, name: str, required: bool, parse) -> Any:
        if name not in self._parsed:
            file = self.path / name
            if not file.is_file():
                if not required:
                    return None
                raise HfTuneError(f"{file}: missing\n  fix: {self._recovery('the output_dir of a finished run', name)}")
            try:
                self._parsed[name] = parse(file.read_text(encoding="utf-8"))
            except ValueError as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors; so is YAML's, below
                raise self._corrupt(name, (str(err).splitlines() or [type(err).__name__])[0]) from None
        return self._parsed[name]

    def _mapping(self, name: str, required: bool) -> dict:
        value = self._read(name, required, _parse_json if name.endswith(".json") else _parse_yaml)
        if value is None and not required:
            return {}
        if not isinstance(value, dict):
            raise self._corrupt(name, f"it holds a {type(value).__name__}, not a mapping")
        return value

    def _whole_safetensors(self, pattern: str) -> None:
        """Each safetensors file of the weights read as far as its header: the header's length, its JSON, and the
        tensors' byte ranges against the file's size (a copy cut short ends before its last tensor)."""
        for file in sorted(self.path.glob(pattern)):
            problem = safetensors_problem(file)
            if problem is not None:
                raise self._corrupt(file.name, problem)

    def _require_one(self, names: tuple[str, ...], what: str) -> None:
        if not any(self.has(name) for name in names):
            raise HfTuneError(f"{self.path}: {what} missing (none of {', '.join(names)})\n  fix: "
                              f"{self._recovery('a finished run folder')}")

    def _corrupt(self, name: str, problem: str) -> HfTuneError:
        return HfTuneError(f"{self.path / name}: unreadable ({problem}): the file is truncated or was edited\n  "
                           f"fix: {self._recovery('a finished run folder', name)}")

    def _recovery(self, wanted: str, name: str | None = None) -> str:
        """How to go on from a missing or unreadable ``name`` (None: the weights or tokenizer): the newest complete
        checkpoint, which keeps its own weights, tokenizer and trainer state; for the files only the run folder has,
        how to write them again."""
        checkpoint = last_complete_checkpoint(self.path)
        recipe = self.path / run_folder.RECIPE
        if name == run_folder.MANIFEST and self.has(run_folder.TRAINER_STATE):  # the run had finished
            return (f"the run's model, trainer_state.json and results are intact, its manifest is not: restore "
                    f"{name} from a copy (a checkpoint mirror keeps one), or train the recipe again into a new "
                    "output_dir")
        if name == run_folder.MANIFEST and checkpoint is not None and recipe.is_file():
            return f"`python -m hf_tune.run {recipe}` resumes from {checkpoint.name} and writes {name} again"
        if name == run_folder.RECIPE and self.has(run_folder.MANIFEST):
            return f"run.json holds the resolved recipe under 'recipe': write it back to {recipe}"
        if name == run_folder.WATCHED_SCORES:
            return (f"remove the broken line (a crash cut it short); `hf-tune eval {self.path} --watch` scores that "
                    "checkpoint again")
        if checkpoint is not None and (name is None or (checkpoint / name).is_file()):
            return f"pass the newest complete checkpoint, {checkpoint}, which keeps its own copy"
        return f"pass {wanted}"


def safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file's framing (the format: an 8-byte little-endian header length, a JSON
    header, then every tensor's bytes at its ``data_offsets``), or None; reads the header only."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a safetensors header"
        length = int.from_bytes(head, "little")
        if length > size - 8:
            return f"its header says {length} bytes of metadata, the file holds {size - 8} after the length"
        try:
            header = json.loads(handle.read(length))
        except ValueError as err:
            return f"its header is not JSON ({err})"
    ends = [entry["data_offsets"][1] for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    if ends and 8 + length + max(ends) > size:
        return f"its tensors need {8 + length + max(ends)} bytes, the file has {size}"
    return None


def _parse_json(text: str) -> Any:
    return json.loads(text)


def _parse_yaml(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"not YAML: {getattr(err, 'problem', None) or type(err).__name__}{where}") from err


def open_run(path: str | Path, needs: Iterable[str] = ()) -> RunFolder:
    """The run folder at ``path``, with what a verb ``needs`` (of ``NEEDS``) checked now: it exists, and each needed
    file is there and reads."""
    path = Path(path)
    if not path.exists():
        raise HfTuneError(f"{path}: no such folder\n  fix: pass the training.output_dir of a run")
    if not path.is_dir():
        raise HfTuneError(f"{path}: a file, not a run folder\n  fix: pass the training.output_dir of a run")
    unknown = set(needs) - set(NEEDS)
    assert not unknown, unknown
    return RunFolder(path).check(needs)


def load_adapter_run(run: RunFolder, model_class, **kwargs):
    """The run's LoRA adapter on its base, as PEFT's ``AutoPeftModel.from_pretrained`` loads it (the base from the
    adapter's config, its embeddings grown to a tokenizer saved with more tokens), except that the base comes from
    ``adapter_base``, which also resolves ``embedded:NAME``. ``kwargs`` go to the base's ``from_pretrained``."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    base_path, revision = run.adapter_base()
    base = model_class.from_pretrained(base_path, revision=revision, **kwargs)
    if run.has("tokenizer_config.json") and hasattr(base, "get_input_embeddings"):
        tokens = len(AutoTokenizer.from_pretrained(run.path))
        if tokens > base.get_input_embeddings().weight.shape[0]:
            base.resize_token_embeddings(tokens)
    return PeftModel.from_pretrained(base, run.path)


def load_model(run_dir: str | Path, **kwargs):
    """The trained model of a run folder, for its ``model.task``: a LoRA adapter on its base (``load_adapter_run``:
    an ``embedded:`` base resolved, which PEFT's ``AutoPeftModel`` cannot), a full fine-tune as saved. ``kwargs`` go
    to ``from_pretrained`` (``dtype=``, ``device_map=``). The notebook's ``hf_tune.load_model``."""

    run = open_run(run_dir)
    model_class = task_of(run.task()).model_class
    if run.weights() == "adapter":  # weights() checks the weight files are there
        return load_adapter_run(run, model_class, **kwargs)
    return model_class.from_pretrained(run.path, **kwargs)
