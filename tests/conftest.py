"""Shared fixtures: the embedded SmolLM2 tokenizer, a tiny random Llama folder, recipe files written in a line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import launch
import pytest
import yaml

from hf_tune.runtime.process import settle_process

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "data"
SMOLLM2 = "embedded:SmolLM2-135M-Instruct"
# `make test` runs the suite on two pytest workers (pytest-xdist): an OpenMP thread that waits spins on a core by
# default, which on two cores starves the other worker's processes; a waiting thread sleeps instead (every process a
# test starts inherits it; it changes no result)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# every DeepSpeed op the session builds (in this process or a launch) goes to the suite's own folder, never the
# user's default one, where a killed build's lock would hang DeepSpeed runs outside the suite
os.environ.setdefault("TORCH_EXTENSIONS_DIR", launch.TORCH_EXTENSIONS["TORCH_EXTENSIONS_DIR"])
# the suite runs as hf_tune's entry points do (importing hf_tune no longer does it): MKL_CBWR and the rest before
# torch's first matmul, so an in-process run and a launched one sum alike (tests compare them bit for bit)
settle_process()


@pytest.fixture(scope="session")
def smol_dir() -> str:
    from hf_tune.model.embedded import embedded_model_path

    return embedded_model_path(SMOLLM2)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smol_tokenizer) -> str:
    """A randomly initialised 2-layer Llama with SmolLM2's tokenizer and chat template: the fast path for tests."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smol_tokenizer)


def save_tiny_llama(folder: Path, tokenizer, seed: int = 0) -> str:
    """A random 2-layer Llama drawn with ``seed`` (same names, shapes and dtypes whatever the seed), saved with
    ``tokenizer`` into ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def nan_model(model_dir: str, folder: Path) -> str:
    """A copy of a causal LM folder with one NaN planted in its final norm: every loss it computes is NaN."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    return str(folder)


def chat_recipe(model: str, output_dir: Path, **training) -> dict:
    """A small chat recipe as a dict: a few short demo chats, short sequences, no eval unless asked."""
    return {
        "model": {"pretrained_model_name_or_path": model},
        "data": {"format": "chat", "train": {"path": str(DATA / "chat_demo.jsonl")}, "max_length": 128},
        "training": {"output_dir": str(output_dir), "max_steps": 2, "per_device_train_batch_size": 2,
                     "learning_rate": 1e-3, "report_to": "none", "logging_steps": 1, "save_strategy": "no",
                     "disable_tqdm": True, **training},
    }


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.fixture
def offline(monkeypatch):
    """No Hub: the shipped config.json is the only source of a big model's shapes."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("hf_tune.runtime.network.hub_is_reachable", lambda *a, **k: False)
    for module in ("hf_tune.assembly.preflight", "hf_tune.model.loading"):
        monkeypatch.setattr(f"{module}.hub_is_reachable", lambda *a, **k: False)


def free_port() -> int:
    """A TCP port nothing listens on now, for a launcher's rendezvous (fixed ports collide with other runs)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> str:
    """A real local MLflow tracking server (SQLite store, served artifacts), started once per session; its URL."""
    import time
    import urllib.request

    folder = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = (folder / "server.log").open("w")
    # without MLflow's job runner: its dozen idle consumer processes would take CPU from the tests all session
    proc = launch.start("mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                        "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination",
                        str(folder / "artifacts"), cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True, env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                break
        except OSError:
            pass
        assert proc.poll() is None and time.time() < deadline, (folder / "server.log").read_text()[-3000:]
        time.sleep(0.3)
    yield url
    os.killpg(proc.pid, signal.SIGKILL)  # the server and its uvicorn worker (SIGTERM takes ~9 s to drain)
    proc.wait(timeout=30)
    log.close()


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """The session's uninterrupted reference runs (tests/runs.py): each recipe trained once, whoever asks."""
    from runs import References

    return References(tmp_path_factory.mktemp("references"))


def pytest_sessionfinish(session) -> None:
    """On a pytest-xdist worker: its launch counts, for the controller's summary."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["launches"] = dict(launch.COUNTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """On the controller, as each worker ends: its launch counts added to the run's."""
    launch.COUNTS.update(getattr(node, "workeroutput", {}).get("launches", {}))


def pytest_terminal_summary(terminalreporter) -> None:
    """The processes the tests started (tests/launch.py), every worker's: a new test's launches show in every run's
    summary."""
    terminalreporter.write_line(launch.summary())
