"""The data pipeline at 10k / 100k / 1M synthetic chats: time and peak RSS of loading, tokenizing and packing, and
hf_tune's packing beside TRL's ``pack_dataset`` (bfd) on the same tokenized data.

Each stage runs in a fresh process (so ``ru_maxrss`` is that stage's own peak) against the same on-disk datasets
cache: ``load`` reads and checks the JSONL into Arrow, ``tokenize`` renders each chat with SmolLM2's template and
writes tokens + labels (the Arrow dataset whose size is reported), ``pack`` is ``pack_by_token_budget``, ``trl``
is ``trl.pack_dataset(strategy="bfd")`` with ``seq_length`` = the same budget (recomputed, never read from its
cache), and ``size`` only imports the libraries and opens the tokenized dataset (the floor every stage pays).

    flock -x /tmp/hf_tune_cpu.lock .venv/bin/python benchmarks/data_pipeline.py --sizes 10000 100000 \\
        --work /tmp/hf_tune_data_bench

``--synthetic-tokens N``: skip chats and tokenization; write N tokenized examples of the chats' lengths straight to
Arrow (the 1M packing comparison: tokenizing a million chats on the 2-core machine takes about 8 minutes).
``--repeats R``: run the two packing stages R times each, alternately, and report the median seconds and every run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORDS = ("the river owl cold market seven quietly bright answer number city train paper green window because "
         "question yellow slowly music garden under before winter copper island").split()
BUDGET = 2048


def write_chats(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            messages = []
            for _ in range(rng.choice((1, 1, 2))):
                messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(5, 40)))})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(5, 120)))})
            f.write(json.dumps({"messages": messages}) + "\n")


def stage(name: str, work: Path, n: int, data: str) -> dict:
    """Run one stage in this process on ``data`` ("chats" or "synthetic"); return its seconds and peak RSS."""
    os.environ["HF_DATASETS_CACHE"] = str(work / "cache")
    from datasets import Dataset
    from transformers import AutoTokenizer  # noqa: F401  every import before any clock starts
    from trl import pack_dataset

    from hf_tune.data.loading import load_source  # noqa: F401
    from hf_tune.data.packing import pack_by_token_budget
    from hf_tune.data.tokenization import tokenize_dataset  # noqa: F401

    start = time.perf_counter()
    out: dict = {}
    if name == "load":
        load_chats(work, n)
    elif name == "tokenize":
        tokenize_chats(work, n, load_chats(work, n), start_clock=out)
    else:
        if data == "synthetic":
            tokenized = Dataset.from_file(str(synthetic_tokens_file(work, n)))
        else:
            tokenized = tokenize_chats(work, n, load_chats(work, n))
        for old in {Path(f["filename"]).parent for f in tokenized.cache_files}:
            for cached in old.glob("packs-*.arrow"):  # measure building the packs, not reading them back
                cached.unlink()
        out["rss_before_mb"] = current_rss_mb()
        start = time.perf_counter()
        if name == "pack":
            out["packs"] = len(pack_by_token_budget(tokenized, BUDGET, seed=0))
        elif name == "trl":
            out["packs"] = len(pack_dataset(tokenized.select_columns(["input_ids", "labels"]), BUDGET, strategy="bfd",
                                            map_kwargs={"load_from_cache_file": False}))
        elif name == "size":  # also the floor: libraries imported, the tokenized dataset opened
            out["arrow_mb"] = sum(os.path.getsize(f["filename"]) for f in tokenized.cache_files) / 2**20
            out["examples"] = len(tokenized)
    out["seconds"] = time.perf_counter() - out.pop("start", start)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def current_rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def load_chats(work: Path, n: int):
    from hf_tune.data.loading import load_source
    from hf_tune.recipe.schema import DatasetSource

    return load_source(DatasetSource(path=str(work / f"chats-{n}.jsonl")), "data.train", "chat")


def tokenize_chats(work: Path, n: int, raw, start_clock: dict | None = None):
    from transformers import AutoTokenizer

    from hf_tune.data.tokenization import tokenize_dataset
    from hf_tune.model.embedded import embedded_model_path
    from hf_tune.recipe.schema import DataSection

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path("embedded:SmolLM2-135M-Instruct"))
    if start_clock is not None:
        start_clock["start"] = time.perf_counter()
    data = DataSection(train={"path": str(work / f"chats-{n}.jsonl")}, max_length=BUDGET,
                       num_proc=int(os.environ.get("NUM_PROC", "1")))
    return tokenize_dataset(raw, tokenizer, data, "data.train")


def synthetic_tokens_file(work: Path, n: int) -> Path:
    return work / f"synthetic-{n}" / "data.arrow"


def write_synthetic_tokens(work: Path, n: int, seed: int = 0, chunk: int = 100_000) -> None:
    """N tokenized examples (input_ids, attention_mask, labels as int64, like tokenize_dataset's) of 20-140 tokens
    (the synthetic chats' range), written chunk by chunk to one Arrow file: generating them never holds them all."""
    import numpy as np
    import pyarrow as pa
    from datasets.arrow_writer import ArrowWriter

    rng = np.random.default_rng(seed)
    synthetic_tokens_file(work, n).parent.mkdir(parents=True, exist_ok=True)
    with ArrowWriter(path=str(synthetic_tokens_file(work, n))) as writer:
        for begin in range(0, n, chunk):
            lengths = rng.integers(20, 140, min(chunk, n - begin))
            offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
            ids = rng.integers(10, 49000, int(lengths.sum()))
            labels = np.where(rng.random(len(ids)) < 0.4, -100, ids)
            as_list = lambda values: pa.ListArray.from_arrays(offsets, pa.array(values, pa.int64()))  # noqa: E731
            writer.write_table(pa.table({"input_ids": as_list(ids), "attention_mask": as_list(np.ones(len(ids))),
                                         "labels": as_list(labels)}))
        writer.finalize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--synthetic-tokens", type=int, nargs="*", default=[])
    parser.add_argument("--work", type=Path, default=Path("/tmp/hf_tune_data_bench"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--stage", nargs=3)  # internal: NAME N DATA, run in a child process
    args = parser.parse_args()
    if args.stage:
        print(json.dumps(stage(args.stage[0], args.work, int(args.stage[1]), args.stage[2])))
        return
    args.work.mkdir(parents=True, exist_ok=True)

    def child(name: str, n: int, data: str) -> dict:
        done = subprocess.run([sys.executable, __file__, "--work", str(args.work), "--stage", name, str(n), data],
                              capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    def packing(n: int, data: str) -> dict:
        """hf_tune's and TRL's packing, each run ``--repeats`` times (alternately): the median run, and all runs."""
        runs = {"pack": [], "trl": []}
        for _ in range(args.repeats):
            for name, done in runs.items():
                done.append(child(name, n, data))
        return {name: {**sorted(done, key=lambda run: run["seconds"])[len(done) // 2],
                       "seconds": statistics.median(run["seconds"] for run in done),
                       "seconds_runs": [round(run["seconds"], 3) for run in done],
                       "peak_rss_mb": max(run["peak_rss_mb"] for run in done)} for name, done in runs.items()}

    for n in args.sizes:
        write_chats(args.work / f"chats-{n}.jsonl", n)
        row = {"n": n, **{name: child(name, n, "chats") for name in ("load", "tokenize", "size")},
               **packing(n, "chats")}
        print(json.dumps(row), flush=True)
    for n in args.synthetic_tokens:
        write_synthetic_tokens(args.work, n)
        row = {"n": n, "synthetic_tokens": True, "size": child("size", n, "synthetic"), **packing(n, "synthetic")}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
