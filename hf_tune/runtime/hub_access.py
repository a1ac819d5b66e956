"""Can this machine read a Hub repo? Online, the Hub says whether the repo and its revision exist and whether this
token may read it (private and gated repos); offline, the local cache says whether it holds the repo. Messages name
the repo and the account's state, never the token."""

from __future__ import annotations

import dataclasses
import logging

from huggingface_hub import HfApi, constants, get_token, try_to_load_from_cache
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

logger = logging.getLogger(__name__)
LOGIN = "`hf auth login` (or set HF_TOKEN)"


@dataclasses.dataclass(frozen=True)
class RepoProblem:
    """Why a repo cannot be read; ``revision``: the recipe's revision key is the one to change."""

    problem: str
    fix: str
    revision: bool = False


def repo_page(repo_id: str, repo_type: str) -> str:
    """The repo's page on the Hub (``HF_ENDPOINT``), where its licence is accepted."""
    return f"{constants.ENDPOINT}/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"


def _asker() -> str:
    return "this machine's Hub token" if get_token() else f"an anonymous request (no Hub token: {LOGIN})"


def hub_repo_problem(repo_id: str, repo_type: str, revision: str | None = None) -> RepoProblem | None:
    """Ask the Hub (``repo_info``, then ``auth_check`` for a gated repo) whether the repo can be read here; None when
    it can, or when the Hub's answer says nothing definite (a 5xx, a rate limit: the load retries then)."""
    api, page = HfApi(), repo_page(repo_id, repo_type)
    try:
        info = api.repo_info(repo_id, repo_type=repo_type, revision=revision)
        if info.gated:  # the Hub describes a gated repo to anyone; only auth_check says whether this token may read it
            api.auth_check(repo_id, repo_type=repo_type)
    except GatedRepoError:
        return RepoProblem(f"{page} is gated, and {_asker()} has not been granted access to it",
                           fix=f"accept its conditions at {page} with your account, then {LOGIN} with a token of "
                               "that account")
    except RevisionNotFoundError:
        return RepoProblem(f"the {repo_type} {repo_id!r} has no revision {revision!r} on the Hub",
                           fix=f"a branch, tag or commit of {page} (or remove the revision: main)", revision=True)
    except RepositoryNotFoundError:
        other = "dataset" if repo_type == "model" else "model"
        return RepoProblem(f"the Hub has no {repo_type} {repo_id!r} that {_asker()} can read (it does not exist, or "
                           "it is private)", fix=f"check the spelling (is it a {other}, or did you mean a local path? "
                           f"local paths start with ./ or /); for a private repo, {LOGIN} with a token that can "
                           "read it")
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else "no status"
        if status == 401:  # not a repo's answer (that is RepoNotFound): the token itself is refused
            return RepoProblem(f"the Hub refused this machine's Hub token (HTTP 401: invalid or expired) when asked "
                               f"about {page}", fix=f"{LOGIN} with a valid token, or unset HF_TOKEN for a public repo")
        logger.warning("The Hub answered HTTP %s about %s; the %s is not checked before loading", status, page,
                       repo_type)
    return None


def model_is_cached(repo_id: str, revision: str | None, subfolder: str | None = None,
                    cache_dir: str | None = None) -> bool:
    """The model's config.json at this revision is in the local Hub cache (what ``from_pretrained`` reads offline)."""
    filename = f"{subfolder.strip('/')}/config.json" if subfolder else "config.json"
    return isinstance(try_to_load_from_cache(repo_id, filename, revision=revision, cache_dir=cache_dir), str)


def dataset_is_cached(repo_id: str) -> bool:
    """``load_dataset`` offline reads a Hub dataset from the datasets cache (``HF_DATASETS_CACHE``), where a load
    online left it; datasets' own ``CachedDatasetModuleFactory`` is what it asks."""
    from datasets.load import CachedDatasetModuleFactory

    try:
        CachedDatasetModuleFactory(repo_id).get_module()
    except FileNotFoundError:
        return False
    return True
