"""Data-plane keys derived from a job's secret, as transport/credentials.h defines them, so that
the launcher can hand each agent its keyring (its own rank key and its pair keys) instead of the
job's secret: one rank's keys cannot speak for another.

    rank_key(S, job, r)    = HMAC-SHA256(S, "poseidon/v1/rank-key" job r)
    pair_key(S, job, a, b) = HMAC-SHA256(S, "poseidon/v1/pair-key" job min(a,b) max(a,b))

(job: 8 bytes little-endian, ranks: 4 bytes little-endian)."""

import hashlib
import hmac

__all__ = ["rank_key", "pair_key", "make_keyring"]


def _le(value, size):
    return int(value).to_bytes(size, "little")


def _derive(secret, label, job, ranks):
    message = label + _le(job, 8) + b"".join(_le(r, 4) for r in ranks)
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def rank_key(secret, job, rank):
    return _derive(secret, b"poseidon/v1/rank-key", job, [rank])


def pair_key(secret, job, a, b):
    return _derive(secret, b"poseidon/v1/pair-key", job, [min(a, b), max(a, b)])


def make_keyring(secret, job, rank, world):
    """The keyring of `rank` in a world of `world` (poseidon-agent --keyring, $POSEIDON_KEYRING)."""
    lines = ["poseidon-keyring 1", f"job {job}", f"rank {rank}", f"world {world}",
             f"server {rank_key(secret, job, rank).hex()}"]
    lines += [f"peer {p} {pair_key(secret, job, rank, p).hex()}" for p in range(world) if p != rank]
    return "\n".join(lines) + "\n"
