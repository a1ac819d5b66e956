"""Bad input: every malformed recipe or data file of the corpus in tests/bad_inputs/ ends in one message that names
the recipe key (and, for data, the file, the line or example, the column and what was expected): exit status 2, no
traceback, no run folder. A corpus recipe whose model is ``tiny-llama`` gets the tiny random Llama of conftest.py."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import launch
import pytest
import yaml
from vision_inputs import tiny_vlm  # noqa: F401  (a fixture: the vision cases' model)

from hf_tune.catalog.methods import METHODS
from hf_tune.catalog.sources import LOCAL_DATA_SUFFIXES
from hf_tune.errors import RecipeError
from hf_tune.recipe.schema import SECTIONS
from hf_tune.run import main

CORPUS = Path(__file__).parent / "bad_inputs"

EXPECTED_KEY = {  # case (tests/bad_inputs/<case>.yaml) -> the recipe key its error must name
    "model_missing_folder": "model.pretrained_model_name_or_path",
    "model_unknown_key": "model.revison",
    "model_bad_task": "model.task",
    "model_bad_attention": "model.attn_implementation",
    "model_unknown_embedded": "model.pretrained_model_name_or_path",
    "model_num_labels_mismatch": "model.num_labels",
    "model_gguf_missing": "model.gguf_file",
    "lora_r_zero": "lora.r",
    "lora_r_negative": "lora.r",
    "lora_no_such_module": "lora.target_modules",
    "lora_unknown_key": "lora.rank",
    "lora_task_type": "lora.task_type",
    "lora_dropout_too_large": "lora.lora_dropout",
    "lora_layers_with_all_linear": "lora.layers_to_transform",
    "data_missing_file": "data.train.path",
    "data_unknown_format": "data.format",
    "data_eval_and_split": "data",
    "data_template_missing": "data.chat_template",
    "data_batch_tokens_too_small": "data.batch_tokens",
    "data_template_binary": "data.chat_template",
    "data_template_syntax": "data.chat_template",
    "chat_broken_line": "data.train",
    "chat_empty_file": "data.train",
    "chat_binary_file": "data.train",
    "chat_blank_lines": "data.train",
    "chat_not_an_object": "data.train",
    "chat_messages_string": "data.train",
    "chat_turn_keys": "data.train",
    "chat_turn_not_object": "data.train",
    "chat_wrong_columns": "data.train",
    "sharegpt_unknown_from": "data.train",
    "sharegpt_role_content": "data.train",
    "instruction_missing_output": "data.train",
    "instruction_output_not_string": "data.train",
    "prompt_completion_list_after_string": "data.train",
    "prompt_completion_null": "data.train",
    "prompt_completion_turn_keys": "data.train",
    "text_not_string": "data.train",
    "text_null": "data.train",
    "text_broken_json_array": "data.train",
    "text_binary_csv": "data.train",
    "text_not_parquet": "data.train",
    "classification_null_label": "data.train",
    "classification_float_label": "data.train",
    "classification_missing_text": "data.train",
    "classification_eval_unknown_label": "data.eval",
    "classification_eval_broken": "data.eval",
    "training_optim_unknown": "training.optim",
    "training_scheduler_unknown": "training.lr_scheduler_type",
    "training_load_best_mismatch": "training.save_strategy",
    "training_negative_lr": "training.learning_rate",
    "training_unknown_key": "training.learning_rat",
    "training_eval_without_data": "training.eval_strategy",
    "training_batch_size_text": "training.per_device_train_batch_size",
    "training_report_to_unknown": "training.report_to",
    "training_compile_backend_unknown": "training.torch_compile_backend",
    "optim_llrd_zero": "optim.layerwise_lr_decay",
    "optim_unknown_key": "optim.head_learning_rate",
    "evaluation_metrics_for_causal_lm": "evaluation.metrics",
    "evaluation_unknown_metric": "evaluation.metrics",
    "evaluation_early_stopping_without_eval": "evaluation.early_stopping_patience",
    "hub_unknown_key": "hub.licence",
    "hub_tags_not_list": "hub.tags",
    "resilience_mirror_credentials": "resilience.checkpoint_mirror",
    "search_data_key": "search.space.data.max_length",
    "search_low_above_high": "search.space.training.learning_rate",
    "tracking_unknown_key": "tracking.projet",
    "tracking_tags_not_list": "tracking.tags",
    "method_unknown": "method",
    "dpo_data_max_length": "data.max_length",
    "grpo_without_rewards": "rewards",
    "preference_chosen_equals_rejected": "data.train",
    "preference_missing_rejected": "data.train",
    "kto_label_not_boolean": "data.train",
    "profile_unknown_key": "profile.activ",
    "machine_gpu_memory_zero": "machine.gpu_memory_gb",
    "machine_micro_batch_that_cannot_fit": "training.per_device_train_batch_size",
    "model_vision_task_on_a_text_model": "model.task",
    "model_unknown_architecture": "model.pretrained_model_name_or_path",
    "resilience_rollback_without_checkpoints": "resilience.rollback_on_nonfinite",
    "data_batch_tokens_typo": "data.batch_token",
    "dpo_flat_pairs_on_sharded_weights": "training.padding_free",
    "dpo_flat_pairs_as_data_key": "data.padding_free",
    # issue 29: the methods wave (DPO, KTO, reward and GRPO data, rewards, quantization, search, mixtures, columns)
    "dpo_prompt_null": "data.train",
    "dpo_chosen_empty": "data.train",
    "dpo_no_shared_prompt": "data.train",
    "dpo_llamafactory_unknown_from": "data.train",
    "kto_missing_label": "data.train",
    "kto_messages_end_with_user": "data.train",
    "kto_completion_empty": "data.train",
    "reward_model_same_answers": "data.train",
    "reward_model_wrong_columns": "data.train",
    "grpo_prompt_empty": "data.train",
    "grpo_chat_data": "data.train",
    "grpo_num_generations_zero": "training.num_generations",
    "grpo_batch_not_whole_groups": "training.per_device_train_batch_size",
    "grpo_eval_batch_not_whole_groups": "training.per_device_eval_batch_size",
    "grpo_generation_batch_and_steps": "training.generation_batch_size",
    "reward_column_missing": "rewards[1]",
    "reward_unknown_name": "rewards[0]",
    "reward_regex_missing_pattern": "rewards[0]",
    "reward_regex_invalid": "rewards[0].pattern",
    "reward_extract_unknown": "rewards[0].extract",
    "reward_not_importable": "rewards[0]",
    "agent_tool_not_importable": "agent.tools[0]",
    "agent_tool_without_type_hints": "agent.tools[0]",
    "agent_environment_without_reset": "agent.environment",
    "agent_names_nothing": "agent",
    "agent_with_rloo": "agent",
    "agent_tool_timeout_zero": "agent.tool_timeout",
    "agent_key_mistyped": "agent.tool",
    "agent_turn_bound_negative": "training.max_tool_calling_iterations",
    "reward_entry_not_mapping": "rewards[0]",
    "rewards_with_dpo": "rewards",
    "quantization_unknown_key": "model.quantization_config.bnb_4bit_quant",
    "quantization_4_and_8_bit": "model.quantization_config.load_in_4bit",
    "quantization_nothing": "model.quantization_config",
    "quantization_quant_type": "model.quantization_config.bnb_4bit_quant_type",
    "quantization_compute_dtype": "model.quantization_config.bnb_4bit_compute_dtype",
    "search_backend_unknown": "search.backend",
    "search_metric_never_produced": "search.metric",
    "search_cv_not_classification": "search.cv",
    "search_wilcoxon_without_cv": "search.pruner",
    "search_method_formats": "search.space.method",
    "data_hub_dataset_missing": "data.train.path",
    "model_hub_repo_missing": "model.pretrained_model_name_or_path",
    "mixture_weight_and_epochs": "data.train[0].weight",
    "mixture_missing_weight": "data.train[1].weight",
    "mixture_empty": "data.train",
    "mixture_with_dpo": "data.train",
    "mixture_source_format": "data.train[1].format",
    "columns_unknown_column": "data.train.columns",
    "columns_two_to_one": "data.train.columns",
    "text_binary_txt": "data.train",
    "text_empty_txt": "data.train",
    "chat_empty_json": "data.train",
    "dpo_binary_json": "data.train",
    "dpo_not_parquet": "data.train",
    "kto_empty_csv": "data.train",
    "grpo_empty_parquet": "data.train",
    "model_flash_attention_missing": "model.attn_implementation",
    "training_save_steps_not_multiple": "training.save_steps",
    "training_liger_not_installed": "training.use_liger_kernel",
    "evaluation_task_mistyped_for_best_model": "evaluation.tasks",
    "evaluation_task_data_missing": "evaluation.tasks",
    "image_missing_file": "data.train",
    "vision_chat_missing_image": "data.train",
    # issue 45: distillation, RLOO, ORPO, SimPO and typed content parts
    "distillation_without_teacher": "teacher",
    "teacher_with_dpo": "teacher",
    "teacher_missing_folder": "teacher.pretrained_model_name_or_path",
    "teacher_unknown_key": "teacher.revison",
    "simpo_loss_type": "training.loss_type",
    "rloo_without_rewards": "rewards",
    "orpo_chosen_empty": "data.train",
    "chat_unknown_part_type": "data.train",
    "chat_part_without_text": "data.train",
}

EXPECTED_TEXT = {  # what the message says besides the key: where in the file, and what was expected
    "lora_no_such_module": ["['no_such_module']",
                            "its linear modules are: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"],
    "model_bad_attention": ["building the model failed: ValueError:", "bogus_attention", "(--debug shows the traceback)"],
    "chat_broken_line": ["data/chat_broken_line.jsonl: line 2, column 49: not valid JSON", "ArrowInvalid"],
    "chat_empty_file": ["data/empty.jsonl: the file is empty"],
    "chat_binary_file": ["data/binary.jsonl: line 1, column 1: not UTF-8 text (byte 0x89)"],
    "chat_blank_lines": ["data/blank_lines.jsonl: the file holds only blank lines"],
    "chat_not_an_object": ["line 2, column 1: expected a JSON object"],
    "chat_messages_string": ["data/chat_messages_string.jsonl, line 2 (example 2 of 2), column 'messages': expected a "
                             "list of {'role', 'content'} turns, got a string ('Hi, how are you?')"],
    "chat_turn_keys": ["line 2 (example 2 of 2), column 'messages': turn 1 has keys ['speaker', 'text'], expected "
                       "'role' and 'content'"],
    "chat_turn_not_object": ["column 'messages': turn 1: expected an object with 'role' and 'content', got a string"],
    "chat_wrong_columns": ["format 'chat' needs a 'messages'", "text_demo.jsonl has ['text']"],
    "sharegpt_unknown_from": ["line 2 (example 2 of 2), column 'conversations': turn 2: unknown 'from' value 'bot'"],
    "sharegpt_role_content": ["column 'conversations': turn 1 has keys ['content', 'role'], expected 'from' and "
                              "'value' (turns with 'role' and 'content' go in a 'messages' column)"],
    "instruction_missing_output": ["missing ['output']"],
    "instruction_output_not_string": ["line 2 (example 2 of 2), column 'output': expected a string, got a list"],
    "prompt_completion_list_after_string": ["column 'completion': the prompt is a string, so the completion must be"],
    "prompt_completion_null": ["line 2 (example 2 of 2), column 'completion': is missing (null)"],
    "prompt_completion_turn_keys": ["column 'prompt': turn 1 has keys ['role', 'text'], expected 'role' and 'content'"],
    "text_not_string": ["column 'text': expected a string, got a list"],
    "text_null": ["line 2 (example 2 of 2), column 'text': is missing (null)"],
    "text_broken_json_array": ["data/text_broken.json: line 3, column 12: not valid JSON"],
    "text_binary_csv": ["data/binary.csv: line 1, column"],
    "text_not_parquet": ["data/not_parquet.parquet: not a Parquet file"],
    "image_missing_file": ["data/images_missing.jsonl, line 2 (example 2 of 2), column 'image': no such image file: "
                           "data/images/gone.png"],
    "vision_chat_missing_image": ["data/vision_chat_missing.jsonl, line 2 (example 2 of 2), column 'images': image 1: "
                                  "no such image file: data/images/gone.png"],
    "classification_null_label": ["line 2 (example 2 of 2), column 'label': is missing (null)"],
    "classification_float_label": ["column 'label': expected a class name (string) or a class id (integer), got a "
                                   "number (0.5)"],
    "classification_missing_text": ["missing ['text']"],
    "classification_eval_unknown_label": ["['politics']"],
    "classification_eval_broken": ["data/cls_eval_broken.jsonl: line 2, column 28: not valid JSON"],
    "training_optim_unknown": ["adamw_magic is not a valid OptimizerNames"],
    "data_template_binary": ["reading the chat template failed: UnicodeDecodeError:"],
    "data_template_syntax": ["reading the chat template failed: TemplateSyntaxError:"],
    "training_report_to_unknown": ["unknown tracker 'weights_and_biases'"],
    "method_unknown": ["unknown method 'dpoo'", "did you mean 'dpo'?"],
    "preference_chosen_equals_rejected": ["data/preference_same.jsonl, line 2 (example 2 of 2), column 'rejected': "
                                          "equals 'chosen'"],
    "preference_missing_rejected": ["missing ['rejected']"],
    "kto_label_not_boolean": ["line 2 (example 2 of 2), column 'label': expected true (desirable) or false, got 'bad'"],
    "training_load_best_mismatch": ["is 'no' and training.eval_strategy is 'steps'", "remove training.load_best_model_at_end"],
    "dpo_prompt_null": ["data/dpo_prompt_null.jsonl, line 2 (example 2 of 2), column 'prompt': is missing"],
    "dpo_chosen_empty": ["line 2 (example 2 of 2), column 'chosen': the answer is empty"],
    "dpo_no_shared_prompt": ["'chosen' and 'rejected' share no prompt"],
    "dpo_llamafactory_unknown_from": ["data/dpo_llamafactory_bad_from.json, example 2 of 2, column 'conversations': "
                                      "turn 1: expected {from: one of"],
    "kto_missing_label": ["missing ['label']", "LLaMA-Factory's 'messages'"],
    "kto_messages_end_with_user": ["data/kto_messages_end_with_user.json, example 2 of 2, column 'messages': the last "
                                   "message has role 'user'"],
    "kto_completion_empty": ["line 2 (example 2 of 2), column 'completion': the completion is empty"],
    "reward_model_same_answers": ["column 'rejected': equals 'chosen'"],
    "reward_model_wrong_columns": ["missing ['chosen', 'rejected']", "chat_demo.jsonl has ['messages']"],
    "grpo_prompt_empty": ["line 2 (example 2 of 2), column 'prompt': the prompt is empty"],
    "grpo_chat_data": ["format 'prompt_only' needs columns ['prompt']"],
    "grpo_num_generations_zero": ["is 0: GRPO compares at least 2 completions", "fix: set training.num_generations"],
    "grpo_batch_not_whole_groups": ["a generation batch of 3 completions", "num_generations (2)",
                                    "per_device_train_batch_size=4"],
    "grpo_eval_batch_not_whole_groups": ["the eval batch of 3 completions", "groups of 2 generations"],
    "reward_column_missing": ["reward 'exact_answer' reads the column(s) ['answer'], which data.train "
                              "(data/grpo_no_answer.jsonl) lacks: it has ['prompt']", "rewards[1].column"],
    "reward_unknown_name": ["did you mean 'exact_answer'?"],
    "reward_not_importable": ["cannot import 'no_such_module_xyz:score'"],
    "agent_tool_not_importable": ["'no_such_module_xyz:lookup' cannot be imported"],
    "agent_tool_without_type_hints": ["join cannot be described to the model", "type hint"],
    "agent_environment_without_reset": ["Counter has no reset method"],
    "agent_names_nothing": ["names no tool and no environment"],
    "agent_with_rloo": ["method 'rloo' runs no tools", "set method: grpo"],
    "agent_key_mistyped": ["did you mean", "tools"],
    "agent_turn_bound_negative": ["is -1", "1 or more"],
    "quantization_unknown_key": ["did you mean 'bnb_4bit_quant_type'?"],
    "search_metric_never_produced": ["'eval_accuracy' is never produced"],
    "search_method_formats": ["the choices read different data formats: data.format is 'preference', but grpo "
                              "reads prompt_only"],
    "mixture_weight_and_epochs": ["is set together with epochs"],
    "columns_unknown_column": ["has no column 'body'"],
    "text_binary_txt": ["data/binary.txt: line 1, column 1: not UTF-8 text"],
    "text_empty_txt": ["data/empty.txt: the file is empty"],
    "chat_empty_json": ["data/empty.json: the file is empty"],
    "dpo_binary_json": ["data/binary.json: line 1, column 1: not UTF-8 text"],
    "dpo_not_parquet": ["data/not_parquet.parquet: not a Parquet file"],
    "kto_empty_csv": ["data/empty.csv: the file is empty"],
    "grpo_empty_parquet": ["data/empty.parquet: not a Parquet file"],
    "model_flash_attention_missing": ["the flash_attn package is not installed",
                                      "pip install flash-attn --no-build-isolation"],
    "training_save_steps_not_multiple": ["(15) is not a multiple of training.eval_steps (10)",
                                         "set training.save_steps to a multiple of 10 (e.g. 20)"],
    "training_liger_not_installed": ["needs the liger_kernel package, which is not installed", "pip install liger-kernel"],
    "evaluation_task_mistyped_for_best_model": ["'hf_tune_arithmtic' is not the task training.metric_for_best_model",
                                                "did you mean 'hf_tune_arithmetic'?"],
    "distillation_without_teacher": ["method 'distillation' learns from a teacher model, and the recipe names none"],
    "teacher_with_dpo": ["only method distillation learns from a teacher; method 'dpo' does not"],
    "teacher_missing_folder": ["no such folder: ./models/teacher-gone"],
    "teacher_unknown_key": ["did you mean 'revision'?"],
    "simpo_loss_type": ["method 'simpo' runs CPOConfig with loss_type 'simpo', the recipe sets 'sigmoid'"],
    "rloo_without_rewards": ["method 'rloo' needs at least one reward function"],
    "orpo_chosen_empty": ["line 2 (example 2 of 2), column 'chosen': the answer is empty"],
    "chat_unknown_part_type": ["data/chat_unknown_part.jsonl, line 2 (example 2 of 2), column 'messages': turn 1: "
                               "content part 2 has type 'input_audio', which chat does not read: expected one of "
                               "'text', 'reasoning', 'tool_call'"],
    "chat_part_without_text": ["line 2 (example 2 of 2), column 'messages': turn 1: content part 1 (text) has keys "
                               "['content', 'type']: its text goes in 'text' (OpenAI) or 'value' (LLaMA-Factory)"],
    "evaluation_task_data_missing": ["the lm-eval task 'house_quiz (data/task_missing_data.yaml)' reads "
                                     "'data/house_quiz_gone.jsonl', which does not exist"],
}

CLI_CASES = ["lora_r_zero", "chat_broken_line", "training_optim_unknown"]  # also run as `python -m hf_tune.run`


def arguments(case: str, tiny_llama_dir: str, out: Path, request=None) -> list[str]:
    """The case's command line; its placeholder models (``tiny-llama``, ``tiny-vlm``) replaced by the fixtures'."""
    recipe = CORPUS / f"{case}.yaml"
    args = [str(recipe), f"training.output_dir={out}"]
    model = yaml.safe_load(recipe.read_text())["model"]["pretrained_model_name_or_path"]
    if model == "tiny-llama":
        args.append(f"model.pretrained_model_name_or_path={tiny_llama_dir}")
    elif model == "tiny-vlm":  # built only for the cases that name it
        args.append(f"model.pretrained_model_name_or_path={request.getfixturevalue('tiny_vlm')}")
    return args


@pytest.mark.parametrize("case", sorted(EXPECTED_KEY))
def test_bad_input_is_one_message_naming_its_key(case, tiny_llama_dir, tmp_path, monkeypatch, capsys, request):
    missing = {"model_flash_attention_missing": "flash_attn", "training_liger_not_installed": "liger_kernel"}
    if case in missing and importlib.util.find_spec(missing[case]) is not None:
        pytest.skip(f"{missing[case]} is installed here")
    monkeypatch.chdir(CORPUS)  # the corpus recipes name their data files relative to it
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        main(arguments(case, tiny_llama_dir, out, request))
    stderr = capsys.readouterr().err
    assert exited.value.code == 2
    assert f"hf_tune: error: {EXPECTED_KEY[case]}: " in stderr
    for text in EXPECTED_TEXT.get(case, []):
        assert text in stderr
    assert "Traceback" not in stderr
    assert not out.exists()


@pytest.mark.parametrize("case", CLI_CASES)
def test_the_command_line_prints_the_message_alone(case, tiny_llama_dir, tmp_path):
    out = tmp_path / "run"
    done = launch.run("python", "-m", "hf_tune.run", *arguments(case, tiny_llama_dir, out), cwd=CORPUS, timeout=300)
    assert done.returncode == 2
    assert f"hf_tune: error: {EXPECTED_KEY[case]}: " in done.stderr
    assert "Traceback" not in done.stderr
    assert "kernels-community" not in done.stderr  # bitsandbytes' note at PEFT's import, on CPUs with AVX512-BF16
    assert not out.exists()


def test_debug_raises_the_error_chained_to_the_library_error(tiny_llama_dir, tmp_path, monkeypatch):
    from peft import NoMatchingPeftModuleError

    monkeypatch.chdir(CORPUS)
    with pytest.raises(RecipeError) as raised:
        main([*arguments("lora_no_such_module", tiny_llama_dir, tmp_path / "run"), "--debug"])
    assert raised.value.key == "lora.target_modules"
    assert isinstance(raised.value.__cause__, NoMatchingPeftModuleError)  # so --debug prints PEFT's traceback too


def test_the_corpus_covers_every_section_and_every_data_format():
    cases = {path.stem for path in CORPUS.glob("*.yaml")}
    assert cases == set(EXPECTED_KEY) and len(cases) >= 105  # 75 before issue 29, 30 more at least
    assert {re.split(r"[.\[]", key)[0] for key in EXPECTED_KEY.values()} == set(SECTIONS)
    recipes = [yaml.safe_load((CORPUS / f"{c}.yaml").read_text()) for c, key in EXPECTED_KEY.items()
               if key in ("data.train", "data.eval")]
    data_cases = [r["data"] for r in recipes]
    formats = {r["data"].get("format") or METHODS[r.get("method", "sft")].formats[0] for r in recipes}
    assert formats == {"chat", "instruction", "prompt_completion", "text", "classification", "preference",
                       "unpaired_preference", "prompt_only", "image_classification", "vision_chat"}
    sharegpt = [d for d in data_cases if isinstance(d["train"], dict) and "sharegpt" in d["train"]["path"]]
    assert sharegpt  # chat data in both shapes: messages and ShareGPT conversations
    paths = [d["train"]["path"] for d in data_cases if isinstance(d["train"], dict)]
    for suffix in LOCAL_DATA_SUFFIXES:  # an unreadable file (binary, empty, broken) of every extension we read
        assert any(p.endswith(suffix) and Path(CORPUS, p).stat().st_size == 0 or "binary" in p or "broken" in p
                   or "not_parquet" in p for p in paths if p.endswith(suffix)), suffix


# When TrainingArguments refuses a value, the error is about one key: the one to name.
REFUSALS = [
    ({"optim": "adamw_magic", "per_device_train_batch_size": 2}, "optim"),  # 2 is inside 'lion_32bit': no match
    ({"save_strategy": "steps", "eval_strategy": "sometimes"}, "eval_strategy"),  # 'steps' is one of the choices
    ({"lr_scheduler_type": "bogus", "per_device_train_batch_size": 8}, "lr_scheduler_type"),
    ({"eval_strategy": "steps", "eval_steps": 10, "save_steps": 15, "load_best_model_at_end": True},
     "load_best_model_at_end"),
    ({"seed": 0, "dataloader_num_workers": 0, "dataloader_prefetch_factor": 2}, "dataloader_prefetch_factor"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "no"}, "lr_scheduler_type"),
    ({"logging_strategy": "steps", "logging_steps": 0, "seed": 3}, "logging_steps"),
    ({"deepspeed": "no_such_config.json", "seed": 1}, "deepspeed"),
    ({"data_seed": 5, "debug": "verbose"}, "debug"),
]


@pytest.mark.parametrize("training, key", REFUSALS, ids=[key for _, key in REFUSALS])
def test_a_refused_training_value_is_blamed_on_its_own_key(training, key, tmp_path):
    from transformers import TrainingArguments

    from hf_tune.recipe.upstream import blame_key

    kwargs = {"output_dir": str(tmp_path), "report_to": "none", **training}
    with pytest.raises(ValueError) as refused:
        TrainingArguments(**kwargs)
    assert blame_key("training", kwargs, str(refused.value)) == f"training.{key}"


@pytest.mark.parametrize("lora, key", [
    ({"r": 0}, "lora.r"), ({"r": -4}, "lora.r"), ({"r": 8, "lora_alpha": 0}, "lora.lora_alpha"),
    ({"r": 8, "lora_dropout": 1.5}, "lora.lora_dropout"),
    ({"r": 8, "target_modules": "all-linear", "layers_to_transform": [0]}, "lora.layers_to_transform"),
])
def test_lora_values_peft_would_refuse_later_are_refused_without_a_model(lora, key):
    from hf_tune.recipe.upstream import check_lora_values

    with pytest.raises(RecipeError) as refused:
        check_lora_values(lora)
    assert refused.value.key == key


def test_a_data_error_leaves_no_run_folder_under_a_tracker_either(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(CORPUS)
    out = tmp_path / "run"
    with pytest.raises(SystemExit):
        main([*arguments("chat_messages_string", tiny_llama_dir, out), "training.report_to=[tensorboard, wandb]"])
    assert "hf_tune: error: data.train: " in capsys.readouterr().err
    assert not out.exists()


def test_a_diverged_run_exits_with_its_own_status(tiny_llama_dir, tmp_path, capsys):
    """Exit statuses (docs/runs.md): 2 for a usage or recipe error, 3 for a run whose loss went NaN."""
    from conftest import chat_recipe, nan_model, write_recipe

    broken = nan_model(tiny_llama_dir, tmp_path / "nan-model")
    recipe = write_recipe(tmp_path / "nan.yaml", chat_recipe(broken, tmp_path / "run"))
    with pytest.raises(SystemExit) as exited:
        main([str(recipe)])
    stderr = capsys.readouterr().err
    assert exited.value.code == 3
    assert "hf_tune: error: training stopped: the loss at step 1 is nan" in stderr and "Traceback" not in stderr


def test_a_bad_command_line_and_a_bad_recipe_exit_2(tmp_path):
    from hf_tune.commands.cli import main as cli_main

    with pytest.raises(SystemExit) as exited:
        cli_main(["validate"])  # no recipe: argparse's usage error
    assert exited.value.code == 2
    with pytest.raises(SystemExit) as exited:
        cli_main(["validate", str(tmp_path / "no_such_recipe.yaml")])
    assert exited.value.code == 2


def test_an_explicit_wandb_online_that_cannot_log_stops_the_run_before_any_folder(tiny_llama_dir, tmp_path,
                                                                                   monkeypatch, capsys):
    """WANDB_MODE=online is the user's choice: without a key for the server it is refused, not turned offline."""
    for name in ("WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.chdir(CORPUS)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:  # lora_r_zero is a good recipe once lora.r is fixed
        main([*arguments("lora_r_zero", tiny_llama_dir, out), "lora.r=4", "training.report_to=wandb"])
    stderr = capsys.readouterr().err
    assert exited.value.code == 2
    assert "hf_tune: error: training.report_to: includes wandb and WANDB_MODE=online is set, but no W&B API key" in stderr
    assert "Traceback" not in stderr and not out.exists()


def test_an_unset_wandb_mode_still_falls_back_to_offline(tmp_path, monkeypatch):
    import os

    from hf_tune.records.wandb_run import _choose_wandb_mode

    for name in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_MODE"):
        monkeypatch.setenv(name, "")  # recorded, so the WANDB_MODE the code sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    _choose_wandb_mode(tmp_path)
    assert os.environ["WANDB_MODE"] == "offline"
