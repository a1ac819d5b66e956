"""Is the Hub reachable from here? Asked once per process and endpoint, through the client library's own HTTP
session."""

from __future__ import annotations

import functools
import logging

from huggingface_hub import constants

logger = logging.getLogger(__name__)


def hub_is_reachable(timeout: float = 3.0) -> bool:
    """One quick request to the Hub endpoint (``HF_ENDPOINT``) through huggingface_hub's own HTTP session, so proxies
    (``HTTPS_PROXY``, ``NO_PROXY``) apply as they do to downloads. Without it, every offline ``from_pretrained`` of a
    Hub id spends tens of seconds in retries before failing or falling back to the cache. ``HF_HUB_OFFLINE=1``: False,
    with no request."""
    if constants.is_offline_mode():
        return False
    return _endpoint_answers(constants.ENDPOINT, timeout)


@functools.cache
def _endpoint_answers(endpoint: str, timeout: float) -> bool:
    from huggingface_hub import get_session

    try:
        status = get_session().head(endpoint, timeout=timeout).status_code
    except Exception as err:  # no answer (DNS, refused, proxy, timeout, TLS): offline for this process
        logger.debug("The Hub (%s) did not answer: %s", endpoint, err)
        return False
    return status < 500  # 5xx: a proxy that cannot reach the Hub, or the Hub itself down


hub_is_reachable.cache_clear = _endpoint_answers.cache_clear  # type: ignore[attr-defined]  (tests ask afresh)
