"""The cluster's shared token: where each side reads it, and how long it must be.

The controller (:class:`~phalanx.backends.cluster.backend.ClusterBackend`'s ``token=``,
``token_file=`` or ``$PHALANX_TOKEN``) and every agent (``phalanx agent --token-file`` or
``$PHALANX_TOKEN``) hold the same secret; the handshake (:mod:`phalanx.wire.handshake`)
proves it both ways. Both sides read it with these rules, so they refuse the same tokens.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

TOKEN_ENV = "PHALANX_TOKEN"
MIN_TOKEN = 16  # bytes: a shorter shared secret is refused


def read_token(token_file: str | None, environ: Mapping[str, str] | None = None) -> bytes:
    """The shared token: from ``token_file``, else ``$PHALANX_TOKEN``; ValueError if there
    is none or it is too short to be a secret."""
    env = os.environ if environ is None else environ
    if token_file is not None:
        path = Path(token_file)
        try:
            token = path.read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the token file {token_file}: {exc}") from None
        mode = path.stat().st_mode
        if mode & (stat.S_IROTH | stat.S_IWOTH):
            logger.warning("the token file %s can be read by anyone on this machine",
                           token_file)
        where = f"the token file {token_file}"
    elif env.get(TOKEN_ENV):
        token, where = env[TOKEN_ENV].strip().encode(), f"${TOKEN_ENV}"
    else:
        raise ValueError(f"a token is required: --token-file FILE or ${TOKEN_ENV} (the same "
                         "secret the controller uses)")
    if len(token) < MIN_TOKEN:
        raise ValueError(f"{where} holds {len(token)} bytes; a token needs at least "
                         f"{MIN_TOKEN} (e.g. python -c 'import secrets; "
                         "print(secrets.token_urlsafe(32))')")
    return token


def given_token(token: str | bytes) -> bytes:
    """A token given as a value (``ClusterBackend(token=...)``), as bytes; ValueError if it
    is too short to be the agents' token."""
    secret = (token.encode() if isinstance(token, str) else bytes(token)).strip()
    if len(secret) < MIN_TOKEN:
        raise ValueError(f"token= holds {len(secret)} bytes; the agents' token has "
                         f"at least {MIN_TOKEN}")
    return secret
