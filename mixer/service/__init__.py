"""Mixing as a service: a mixture's readers as Ray actors (e.g. on CPU-only nodes), feeding trainers
with the same batches, the same state format and exact resume as an in-process loader.

Needs Ray (``pip install 'wds-mixer[ray]'``), imported on first use; see the "Mixing as a service" guide.
"""

from mixer.service.remote_loader import RemoteLoader, make_remote_loader
from mixer.service.service import MixerService

__all__ = ["MixerService", "RemoteLoader", "make_remote_loader"]
