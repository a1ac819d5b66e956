"""W&B, an entry of the tracker table (``hf_tune.catalog.trackers``): it logs online when it can, else offline into
the run folder (one warning says how to sync it later); one W&B run per run folder across resumes (its id in
``wandb_run_id``); the recipe as the run's config; the evaluation's samples as a table. Trainer's ``WandbCallback``
logs the metrics."""

from __future__ import annotations

import configparser
import functools
import logging
import netrc
import os
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from hf_tune.catalog.trackers import TRACKERS
from hf_tune.errors import RecipeError
from hf_tune.recipe.schema import Recipe

logger = logging.getLogger(__name__)

WANDB_CLOUD = "https://api.wandb.ai"


def wandb_can_sync(timeout: float = 3.0) -> tuple[bool, str]:
    """(can a W&B run log online, why not): the W&B server the run would log to (``wandb_base_url``) has an API key
    here and answers a request made as W&B's own client makes it, through the environment's proxies.
    ``WANDB_MODE=offline`` or ``disabled`` decides without asking."""
    mode = os.environ.get("WANDB_MODE")
    if mode in ("offline", "disabled", "dryrun"):
        return False, f"WANDB_MODE={mode}"
    url = wandb_base_url()
    if not (os.environ.get("WANDB_API_KEY") or _netrc_has(urlsplit(url).netloc)):
        return False, f"no W&B API key for {url} (WANDB_API_KEY, or `wandb login --host {url}`)"
    if not server_answers(url, timeout):
        return False, f"the W&B server {url} does not answer"
    return True, ""


def wandb_base_url() -> str:
    """The W&B server runs log to, found where W&B looks: ``WANDB_BASE_URL``, then the ``base_url`` that
    `wandb login --host` saved in W&B's settings file, then the public cloud."""
    if url := os.environ.get("WANDB_BASE_URL"):
        return url.rstrip("/")
    settings = configparser.ConfigParser()
    settings.read(Path(os.environ.get("WANDB_CONFIG_DIR", Path.home() / ".config" / "wandb")) / "settings")
    return settings.get("default", "base_url", fallback=WANDB_CLOUD).rstrip("/")


@functools.cache
def server_answers(url: str, timeout: float = 3.0) -> bool:
    """One HEAD request with `requests`, the HTTP library of W&B's Python client: it honours ``HTTPS_PROXY``,
    ``HTTP_PROXY`` and ``NO_PROXY``. Cached per URL, so the runs of a search or a cv do not each wait on a server
    that is down. A 5xx (a proxy that cannot reach the server, or the server itself failing) counts as no answer."""
    import requests

    try:
        return requests.head(url, timeout=timeout, allow_redirects=True).status_code < 500
    except requests.RequestException:
        return False


def _netrc_has(host: str) -> bool:
    """Whether the netrc file (``NETRC``, else ~/.netrc) holds a password for ``host`` (host[:port], as W&B keys it)."""
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc")).expanduser()
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def configure_wandb(recipe: Recipe, run_dir: Path) -> None:
    """The run's project, group, tags, name, folder, mode and run id, where the environment does not already say."""
    tracking = recipe.tracking
    env = {"WANDB_PROJECT": tracking.project, "WANDB_RUN_GROUP": tracking.group,
           "WANDB_TAGS": ",".join(tracking.tags) if tracking.tags else None, "WANDB_NAME": tracking.name,
           "WANDB_DIR": str(run_dir)}
    _choose_wandb_mode(run_dir)
    for key, value in env.items():
        if value and key not in os.environ:
            os.environ[key] = value
    os.environ.setdefault("WANDB_RUN_ID", wandb_run_id(run_dir))
    os.environ.setdefault("WANDB_RESUME", "allow")


WANDB_ONLINE_MODES = ("online", "run", "shared")  # WANDB_MODE values that log to the server


def _choose_wandb_mode(run_dir: Path) -> None:
    """W&B logs online when it can, else offline into the run folder (said in one warning). A ``WANDB_MODE`` the
    user set wins: an explicit online mode that cannot work stops the run here, before anything is written."""
    if os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        return
    online, why = wandb_can_sync()
    if online:
        return
    check_explicit_wandb_online(why)
    os.environ["WANDB_MODE"] = "offline"
    logger.warning("W&B: %s, so this run logs offline under %s/wandb; sync it later with "
                   "`wandb sync %s/wandb/offline-run-*`", why, run_dir, run_dir)


def check_explicit_wandb_online(why: str | None = None) -> None:
    """An explicit ``WANDB_MODE=online`` that cannot log (no API key, no answer) is refused; ``why``: the reason
    already found, else asked now. Called when the recipe loads, and again when the run's trackers start."""
    mode = os.environ.get("WANDB_MODE")
    if mode not in WANDB_ONLINE_MODES:
        return
    if why is None:
        online, why = wandb_can_sync()
        if online:
            return
    raise RecipeError("training.report_to", f"includes wandb and WANDB_MODE={mode} is set, but {why}",
                      fix="log in (WANDB_API_KEY, or `wandb login`) on a machine that reaches the server; or unset "
                      "WANDB_MODE: hf_tune then logs offline into the run folder, for `wandb sync` later")


def wandb_run_id(run_dir: Path) -> str:
    """One W&B run per run folder, kept in ``run_dir/wandb_run_id``: a resumed run continues it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    id_file = run_dir / TRACKERS["wandb"].run_id_file
    if not id_file.is_file():
        # every rank gets here at once: the first id linked into place wins, and no rank reads a half-written file
        staged = id_file.with_name(f".wandb_run_id.{os.getpid()}")
        staged.write_text(uuid.uuid4().hex[:12])
        try:
            os.link(staged, id_file)
        except FileExistsError:
            pass
        finally:
            staged.unlink()
    return id_file.read_text().strip()



def active_wandb_run():
    """W&B's run in this process (W&B itself not imported if nothing imported it)."""
    wandb = sys.modules.get("wandb")
    return wandb.run if wandb is not None else None


def close_wandb_run(run_dir: Path, handle, status: str) -> None:
    """Finish the run, and tear W&B down: it reads WANDB_* once per process setup, so the next run sets up anew."""
    wandb = sys.modules["wandb"]
    if wandb.run is not None:
        wandb.finish()
    wandb.teardown()


def wandb_recipe_config(recipe: dict) -> None:
    """The resolved recipe as the open run's config, beside Trainer's arguments."""
    wandb = sys.modules["wandb"]
    if wandb.run is not None:
        wandb.config.update({"hf_tune_recipe": recipe}, allow_val_change=True)


def wandb_samples(args, rows: list[dict], path: Path, step: int) -> None:
    """The evaluation's samples as a table of the open run."""
    import wandb

    if wandb.run is not None:
        table = wandb.Table(columns=["step", "prompt", "completion"],
                            data=[[r["step"], r["prompt"], r["completion"]] for r in rows])
        wandb.run.log({"eval/samples": table}, commit=False)
