"""Checkpoints mirrored to object storage (``resilience.checkpoint_mirror``, any fsspec URL), and restored from it.

Each complete checkpoint (its ``hf_tune_complete.json`` written) is hard-linked aside at once, so that Trainer's
rotation may delete it meanwhile, and uploaded by one background thread of the main process while training goes
on: its files first, the marker last, so a checkpoint cut off mid-upload is never counted complete there. The run
folder's small files (recipe.yaml, run.json, the tracker ids) follow each checkpoint. With
``training.save_total_limit`` the mirror keeps what Trainer's rotation kept in ``output_dir``. The uploads are
awaited when training ends (and on any error), before the process exits.

On a machine whose ``output_dir`` holds no complete checkpoint, ``restore_from_mirror`` (run by the main process
before the resume choice) downloads the newest complete checkpoint of the mirror, and the run files it lacks.
Credentials come from the environment (``AWS_*``, fsspec's config), never from the recipe.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import shutil
from pathlib import Path

from transformers import TrainerCallback

from hf_tune import run_folder
from hf_tune.catalog.trackers import tracker_files
from hf_tune.errors import HfTuneError
from hf_tune.trainer.checkpoints import MARKER, checkpoints, is_complete, last_complete_checkpoint

logger = logging.getLogger(__name__)
RUN_FILES = (run_folder.RECIPE, run_folder.MANIFEST, *tracker_files("run_id_file"))
STAGING = ".mirror_upload"  # in output_dir: hard links of the checkpoints waiting for their upload


def open_mirror(url: str):
    """(filesystem, root path) of a mirror URL; the filesystem is configured from the environment by fsspec."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, root = fsspec.core.url_to_fs(url)
    if isinstance(fs, LocalFileSystem):  # a shared folder: its subfolders made as files are put
        fs = LocalFileSystem(auto_mkdir=True)
    return fs, root.rstrip("/")


def remote_checkpoints(fs, root: str) -> dict[int, str]:
    """step -> path of every checkpoint-N folder in the mirror."""
    fs.invalidate_cache()  # another machine may have written since this process listed
    try:
        names = fs.ls(root, detail=False)
    except FileNotFoundError:
        return {}
    found = {}
    for name in names:
        match = run_folder.CHECKPOINT.match(name.rstrip("/").rsplit("/", 1)[-1])
        if match:
            found[int(match.group(1))] = name.rstrip("/")
    return found


def remote_is_complete(fs, checkpoint: str) -> bool:
    """The mirror's checkpoint holds its marker, and every file the marker lists with that size."""
    try:
        files = json.loads(fs.cat_file(f"{checkpoint}/{MARKER}"))["files"]
        sizes = {path.rsplit(f"{checkpoint}/", 1)[-1]: info["size"]
                 for path, info in fs.find(checkpoint, detail=True).items()}
    except (OSError, ValueError, KeyError):
        return False
    return bool(files) and all(sizes.get(name) == size for name, size in files.items())


def newest_remote_checkpoint(fs, root: str) -> str | None:
    for _, path in sorted(remote_checkpoints(fs, root).items(), reverse=True):
        if remote_is_complete(fs, path):
            return path
        logger.warning("Ignoring the mirror's %s: it was not completely uploaded", path)
    return None


def restore_from_mirror(output_dir: Path, url: str) -> Path | None:
    """Download the mirror's newest complete checkpoint into ``output_dir`` when ``output_dir`` holds none, with the
    run files it lacks (recipe.yaml, run.json, tracker ids: the trackers continue their run). The checkpoint's marker
    comes last, so an interrupted download is not counted complete. Returns the downloaded checkpoint."""
    if last_complete_checkpoint(output_dir) is not None:
        return None
    try:
        fs, root = open_mirror(url)
        newest = newest_remote_checkpoint(fs, root)
    except Exception as err:  # noqa: BLE001 - the backend's own errors (botocore's, gcsfs'), named for the user
        raise HfTuneError(f"resilience.checkpoint_mirror: cannot list {url}: {type(err).__name__}: {err}\n  fix: "
                          "check the credentials and endpoint in the environment (AWS_PROFILE or AWS_ACCESS_KEY_ID / "
                          "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, GOOGLE_APPLICATION_CREDENTIALS) and that the "
                          "bucket exists") from err
    if newest is None:
        return None
    output_dir.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        if not (output_dir / name).exists() and fs.exists(f"{root}/{name}"):
            fs.get_file(f"{root}/{name}", str(output_dir / name))
    local = output_dir / newest.rsplit("/", 1)[-1]
    shutil.rmtree(local, ignore_errors=True)
    for path in sorted(fs.find(newest), key=lambda p: p.endswith(f"/{MARKER}")):  # the marker last
        target = local / path.rsplit(f"{newest}/", 1)[-1]
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(path, str(target))
    if not is_complete(local):
        raise OSError(f"{url}: {local.name} downloaded from the mirror does not match its marker")
    logger.info("Downloaded %s from the checkpoint mirror %s into %s", local.name, url, output_dir)
    return local


class CheckpointMirror(TrainerCallback):
    """Uploads each complete checkpoint and the run files in the background, from the main process only."""

    def __init__(self, url: str):
        self.url = url
        self.fs, self.root = open_mirror(url)
        self.uploads = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-mirror")
        self.pending: list[concurrent.futures.Future] = []
        self.failed: list[str] = []

    def on_save(self, args, state, control, **kwargs):
        # after CheckpointMarker (attached before this callback): the checkpoint is complete, or was not written
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not state.is_world_process_zero or state.is_hyper_param_search or not is_complete(checkpoint):
            return
        staged = _hard_link_copy(checkpoint, Path(args.output_dir) / STAGING / checkpoint.name)
        kept = {p.name for p in checkpoints(Path(args.output_dir))} if args.save_total_limit else None
        self.pending.append(self.uploads.submit(self._upload, staged, Path(args.output_dir), kept))

    def upload_run_files(self, output_dir: Path) -> None:
        """Queue the run folder's small files (after the final manifest, for instance)."""
        self.pending.append(self.uploads.submit(self._upload_run_files, output_dir))

    def wait(self) -> None:
        """Block until every queued upload ended; report those that failed (training is not failed for them)."""
        concurrent.futures.wait(self.pending)
        self.pending.clear()
        if self.failed:
            logger.error("checkpoint mirror %s: %d upload(s) failed: %s", self.url, len(self.failed),
                         "; ".join(self.failed))

    def _upload(self, staged: Path, output_dir: Path, kept: set[str] | None) -> None:
        remote = f"{self.root}/{staged.name}"
        try:
            if self.fs.exists(f"{remote}/{MARKER}"):  # a checkpoint of this step uploaded before: no longer complete
                self.fs.rm_file(f"{remote}/{MARKER}")
            files = sorted((p for p in staged.rglob("*") if p.is_file()), key=lambda p: p.name == MARKER)
            for path in files:  # the marker last
                self.fs.put_file(str(path), f"{remote}/{path.relative_to(staged).as_posix()}")
            self._upload_run_files(output_dir)
            if kept is not None:
                self._rotate(kept | {staged.name})
            logger.info("Mirrored %s to %s", staged.name, self.url)
        except Exception as err:  # noqa: BLE001 - a failed upload must not stop training; reported at the end
            logger.error("checkpoint mirror: uploading %s to %s failed: %s", staged.name, self.url, err)
            self.failed.append(f"{staged.name}: {err}")
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    def _upload_run_files(self, output_dir: Path) -> None:
        for name in RUN_FILES:
            if (output_dir / name).is_file():
                self.fs.put_file(str(output_dir / name), f"{self.root}/{name}")

    def _rotate(self, kept: set[str]) -> None:
        """Trainer's ``save_total_limit`` rotation, repeated on the mirror: checkpoints no longer in output_dir go."""
        for path in remote_checkpoints(self.fs, self.root).values():
            if path.rsplit("/", 1)[-1] not in kept:
                if self.fs.exists(f"{path}/{MARKER}"):
                    self.fs.rm_file(f"{path}/{MARKER}")  # incomplete first, then gone
                self.fs.rm(path, recursive=True)


def _hard_link_copy(source: Path, target: Path) -> Path:
    """``source``'s files hard-linked under ``target`` (a copy where the file system has no hard links)."""
    shutil.rmtree(target, ignore_errors=True)
    for path in source.rglob("*"):
        if path.is_file():
            destination = target / path.relative_to(source)
            destination.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, destination)
            except OSError:
                shutil.copy2(path, destination)
    return target


def mirror_restore(url: str | None):
    """What ``resume_checkpoint`` runs first: the download from the mirror at ``url`` (None: no mirror)."""
    return None if url is None else functools.partial(restore_from_mirror, url=url)


@contextlib.contextmanager
def mirror_uploads(trainer, mirror: CheckpointMirror | None):
    """On leaving (the run finished, failed or stopped): the run files uploaded once more by ``mirror`` (the
    trainer's, None without one), and every upload awaited."""
    try:
        yield
    finally:
        if mirror is not None and trainer.is_world_process_zero():
            mirror.upload_run_files(Path(trainer.args.output_dir))
            mirror.wait()
