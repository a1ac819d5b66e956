"""Where a study lives: an Optuna storage opened from ``search.storage`` (SQLite in the study folder by default), so
rerunning the same command continues the study, and several processes or machines pointed at one storage share
its trials."""

from __future__ import annotations

import time
from pathlib import Path

import optuna

from hf_tune import run_folder
from hf_tune.errors import HfTuneError
from hf_tune.recipe.schema import SearchSection


def storage_url(search: SearchSection, study_dir: Path) -> str:
    """Where the study lives: ``search.storage``, or the SQLite file ``study_dir/study.db``."""
    return search.storage or f"sqlite:///{(study_dir / run_folder.STUDY_DB).resolve()}"


def is_journal(url: str) -> bool:
    return url.endswith((".log", ".journal"))


def make_storage(search: SearchSection, study_dir: Path):
    """The study's storage: a journal file (``.log``/``.journal``), a database URL, or ``study_dir/study.db``."""
    url = storage_url(search, study_dir)
    if is_journal(url):  # a journal file: NFS-friendly, several workers
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url))
    if not url.startswith("sqlite:///") or url.endswith(":memory:"):
        return open_rdb(url)
    # A new SQLite file: the processes open it one at a time (see open_rdb), so none waits out a locked database.
    from filelock import FileLock

    path = Path(url.removeprefix("sqlite:///"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        return open_rdb(url)


def open_rdb(url: str, attempts: int = 5):
    """An Optuna database storage. Optuna writes a new database's schema on first open, and processes doing that at
    once (workers started together on a new study) fail with "table studies already exists" or "UNIQUE constraint
    failed: alembic_version": the schema is there when the loser tries again. Heartbeats let a restarted study mark
    the trials of a killed worker as failed instead of running forever."""
    import random

    from optuna.exceptions import StorageInternalError
    from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, heartbeat_interval=30, grace_period=90)
        except (OperationalError, IntegrityError, ProgrammingError, StorageInternalError) as err:
            if attempt == attempts - 1:
                raise HfTuneError(f"search.storage: could not open {redact_url(url)} ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0]})\n  fix: check that the database server is reachable "
                                  "and the URL's user may create tables") from err
            time.sleep(0.2 * (attempt + 1) * (1 + random.random()))


def redact_url(url: str) -> str:
    """The URL without its password (errors and logs must not carry it)."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy can parse: say nothing of it
        return "the storage URL"
