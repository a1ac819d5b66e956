"""Credentials in URLs never leave the process (hf_tune/redaction.py): a mirror URL that carries them is
refused whatever the password holds, and every error message and log line hf_tune prints has them masked, in each
link of an fsspec chain and in query strings."""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
from conftest import chat_recipe

from hf_tune import load_recipe
from hf_tune.commands.command_line import RedactingFormatter, user_errors
from hf_tune.errors import HfTuneError, RecipeError

SECRET = "Sup3r/S3cr@t+key"  # a "/", an "@" and a "+": the shapes that slipped past the old check
NASTY = [
    f"s3://AKIAEXAMPLE:{SECRET}@ckpts/run",
    f"simplecache::s3://AKIAEXAMPLE:{SECRET}@ckpts/run",
    f"filecache::gs://bucket/x::s3://user:{SECRET}@bucket/run",
    f"https://minio.local:9000/ckpts?X-Amz-Signature={SECRET.replace('/', '').replace('@', '')}&X-Amz-Date=1",
    "az://container/run?sas_token=sv2024sigAbCdEf",
]


def hidden(url: str) -> str:
    """The secret part of each URL above, which must never be printed."""
    return "sv2024sigAbCdEf" if "sas_token" in url else "Sup3rS3crt+key" if "Signature" in url else SECRET


@pytest.mark.parametrize("url", NASTY)
def test_a_mirror_url_with_credentials_is_refused_without_echoing_them(url, tmp_path, tiny_llama_dir):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run")
    raw["resilience"] = {"checkpoint_mirror": url}
    with pytest.raises(RecipeError) as info:
        load_recipe(raw)
    assert info.value.key == "resilience.checkpoint_mirror" and "holds credentials" in str(info.value)
    assert hidden(url) not in str(info.value) and not (tmp_path / "run").exists()


@pytest.mark.parametrize("url", NASTY)
def test_errors_and_log_lines_mask_the_credentials_of_any_url(url, capsys):
    with pytest.raises(SystemExit) as stopped:
        with user_errors(debug=False):
            raise HfTuneError(f"cannot open {url!r}: access denied")
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "cannot open" in err and hidden(url) not in err and "***" in err
    record = logging.LogRecord("s3fs", logging.WARNING, __file__, 1, "retrying %s", (url,), None)
    line = RedactingFormatter("%(name)s: %(message)s").format(record)
    assert line.startswith("s3fs: retrying ") and hidden(url) not in line and "***" in line


def test_urls_without_credentials_are_printed_as_they_are(capsys):
    plain = "s3://bucket/path@v2/run:1 and ftp://anonymous@host/x"
    with pytest.raises(SystemExit):
        with user_errors(debug=False):
            raise HfTuneError(f"cannot open {plain}")
    assert plain in capsys.readouterr().err


@pytest.mark.slow
def test_nothing_a_run_writes_prints_or_logs_holds_a_planted_secret(tmp_path, tiny_llama_dir, mlflow_server,
                                                                      monkeypatch, capfd, caplog):
    """A tracking URI with a password, training data read from a URL with a password, secrets in the environment the
    trackers and storage read, one on the command line: a LoRA run with checkpoints, logged to a real MLflow server,
    and pushed to a stand-in Hub, then grepped whole (every file of its run folder, every uploaded file, its MLflow
    params and tags, everything printed and logged).
    The checkpoint mirror, the other URL a recipe takes, refuses credentials outright (tests above)."""
    import sys

    from fake_hub import FakeHub
    from huggingface_hub import constants
    from mlflow import MlflowClient

    from hf_tune import train
    from hf_tune.workflows.hub import push

    secrets = {"uri": "Pl4ntedUriPassw0rd", "HF_TOKEN": "hf_" + "Pl4nted" * 5, "AWS_SECRET_ACCESS_KEY": "Pl4ntedAws",
               "WANDB_API_KEY": "Pl4ntedWandb", "MLFLOW_TRACKING_PASSWORD": "Pl4ntedMlflow", "argv": "Pl4ntedArgv",
               "data": "Pl4ntedDataPassw0rd"}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.replace("://", f"://hf_tune:{secrets['uri']}@"))
    for name in ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "WANDB_API_KEY", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, secrets[name])
    monkeypatch.setattr(sys, "argv", ["hf_tune.run", "recipe.yaml",
                                      f"tracking.note=s3://key:{secrets['argv']}@bucket/x"])
    run_dir = tmp_path / "run"
    raw = chat_recipe(tiny_llama_dir, run_dir, max_steps=2, report_to="mlflow", save_strategy="steps", save_steps=1)
    raw["lora"] = {"r": 2, "target_modules": ["q_proj"]}
    raw["tracking"] = {"project": "planted-secrets"}
    with data_served_over_http(tmp_path / "served") as host:  # the training data at a URL with a password
        raw["data"]["train"] = {"path": "json", "data_files": f"http://reader:{secrets['data']}@{host}/train.jsonl"}
        with caplog.at_level(logging.INFO):
            train(load_recipe(raw))
    with FakeHub() as hub:  # and the upload: the adapter with its card, the manifest and the tracker logs too
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        with caplog.at_level(logging.INFO):
            push(run_dir, "me/planted", base_model="org/tiny-llama", include_manifest=True, include_logs=True)
    [commit] = hub.commits
    printed = capfd.readouterr()
    assert (run_dir / "checkpoint-2" / "adapter_model.safetensors").is_file() and (run_dir / "mlflow_run_id").is_file()
    written = {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert {"adapter_model.safetensors", "README.md", "recipe.yaml", "run.json"} <= set(commit["files"])
    written.update({f"uploaded {name}": data for name, data in commit["files"].items()})
    client = MlflowClient(mlflow_server)
    run = client.search_runs([client.get_experiment_by_name("planted-secrets").experiment_id])[0]
    logged = json.dumps({**run.data.params, **run.data.tags})
    for what, secret in secrets.items():
        assert not [name for name, data in written.items() if secret.encode() in data], what
        assert secret not in printed.out + printed.err + caplog.text + logged, what


@contextlib.contextmanager
def data_served_over_http(folder):
    """The first 24 demo chats served over HTTP on localhost (the password in a URL is the client's to send; this
    server reads none). Yields ``host:port``."""
    import functools
    import http.server
    import threading

    from conftest import DATA

    folder.mkdir(parents=True)
    rows = (DATA / "chat_demo.jsonl").read_text().splitlines()[:24]
    (folder / "train.jsonl").write_text("\n".join(rows) + "\n")
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # its request lines are not the run's output
            pass

    handler = functools.partial(Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
