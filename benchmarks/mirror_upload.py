"""How long training waits for the checkpoint mirror (resilience.checkpoint_mirror), against how long the upload takes.

A checkpoint of SmolLM2-135M's real files (542 MB) is handed to ``CheckpointMirror.on_save`` as Trainer would hand it
after a save; the time on_save takes is what training waits (the checkpoint is hard-linked aside), then the background
upload to moto's S3 server on 127.0.0.1 over HTTP is awaited and timed.

    .venv/bin/python benchmarks/mirror_upload.py
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace


def main() -> None:
    import boto3
    from moto.server import ThreadedMotoServer

    from hf_tune.model.embedded import embedded_model_path
    from hf_tune.trainer.checkpoints import mark_complete
    from hf_tune.trainer.mirror import CheckpointMirror

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="testing",
                      AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    boto3.client("s3").create_bucket(Bucket="bench")
    source = Path(embedded_model_path("embedded:SmolLM2-135M-Instruct"))
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = Path(folder) / "checkpoint-1"
        checkpoint.mkdir()
        for path in source.iterdir():
            if path.is_file():
                shutil.copy2(path, checkpoint / path.name)
        mark_complete(checkpoint)
        size = sum(p.stat().st_size for p in checkpoint.iterdir())
        mirror = CheckpointMirror("s3://bench/run")
        start = time.perf_counter()
        mirror.on_save(SimpleNamespace(output_dir=folder, save_total_limit=None),
                       SimpleNamespace(global_step=1, is_world_process_zero=True, is_hyper_param_search=False), None)
        handed = time.perf_counter()
        mirror.wait()
        done = time.perf_counter()
    server.stop()
    print(f"checkpoint {size / 1e6:.0f} MB: training waits {1e3 * (handed - start):.1f} ms (on_save); the upload "
          f"takes {done - handed:.1f} s in the background (failed: {mirror.failed or 'none'})")


if __name__ == "__main__":
    main()
