"""The network boundary with the Hugging Face Hub."""

from __future__ import annotations

import functools
import socket
from urllib.parse import urlparse

from huggingface_hub import constants


@functools.cache
def hub_is_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP probe of the Hub endpoint (``HF_ENDPOINT``). Without it, every offline ``from_pretrained`` of a
    Hub id spends ~25 s in retries before failing or falling back to the cache."""
    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
        return True
    except OSError:
        return False
