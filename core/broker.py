"""The embedded Celery broker: kombu's filesystem transport, with messages that appear whole.

kombu's ``filesystem`` transport creates a message file under its final name and then writes it.
A worker that lists the folder in between moves the file away, reads it empty (or cut short),
fails to decode it and stops: "Unrecoverable error: JSONDecodeError", the message lost, and with
it the embedded control plane (the quickstart's e2e test saw it while two nodes reported at
once). Here each message is written under a name the consumer does not take (its name plus
``.tmp``: kombu only reads files whose name ends in ``.<queue>.msg``) and renamed into place,
which is atomic within one filesystem, so a consumer sees a message whole or not at all.

Registered as the broker URL scheme ``nightwatch-filesystem://`` (``controlplane/settings.py``);
the consumer side, and everything else, is kombu's.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

SCHEME = "nightwatch-filesystem"


class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        """Put ``payload`` on ``queue``: written aside, then renamed to the name kombu reads."""
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        aside = final + ".tmp"
        try:
            with open(aside, "wb", buffering=0) as handle:
                handle.write(str_to_bytes(dumps(payload)))
            os.replace(aside, final)
        except OSError as error:
            raise ChannelError(f"Cannot add file {final!r} to directory") from error


class Transport(filesystem.Transport):
    Channel = Channel


TRANSPORT_ALIASES[SCHEME] = f"{__name__}:Transport"
