"""The embedded broker's messages appear whole: a consumer looking while one is being written
finds nothing rather than an empty file (kombu's own filesystem transport can hand it one)."""

from __future__ import annotations

import os
from queue import Empty

import pytest
from kombu import Connection
from kombu.transport import filesystem

from core import broker


@pytest.fixture
def channel(tmp_path):
    folders = {name: tmp_path / name for name in ("queue", "processed", "control")}
    for folder in folders.values():
        folder.mkdir()
    options = {"data_folder_in": str(folders["queue"]), "data_folder_out": str(folders["queue"]),
               "processed_folder": str(folders["processed"]), "store_processed": False,
               "control_folder": str(folders["control"])}
    with Connection(f"{broker.SCHEME}://", transport_options=options) as connection:
        yield connection.default_channel


def test_the_scheme_names_this_transport(channel):
    assert isinstance(channel, broker.Channel)


def test_a_message_being_written_is_not_there_yet_and_arrives_whole(channel, monkeypatch):
    payload = {"body": "x" * 100_000, "properties": {"delivery_tag": "1"}}
    seen_while_writing = []
    rename = os.replace

    def replace(source, destination):
        try:  # the consumer looks right now: the file is complete, just not under its name
            seen_while_writing.append(channel._get("celery"))
        except Empty:
            seen_while_writing.append(None)
        rename(source, destination)

    monkeypatch.setattr(os, "replace", replace)
    channel._put("celery", payload)
    assert seen_while_writing == [None]
    assert channel._get("celery") == payload
    with pytest.raises(Empty):
        channel._get("celery")


def test_kombus_own_transport_hands_out_a_message_being_written(tmp_path):
    """Why core.broker exists: in kombu's, the file is visible (and taken) before it is written."""
    queue = tmp_path / "queue"
    queue.mkdir()
    options = {"data_folder_in": str(queue), "data_folder_out": str(queue), "store_processed": False,
               "processed_folder": str(tmp_path), "control_folder": str(tmp_path)}
    with Connection("filesystem://", transport_options=options) as connection:
        plain = connection.default_channel
        assert type(plain) is filesystem.Channel
        (queue / "1_x.celery.msg").write_bytes(b"")  # created, not yet written, as kombu's _put does
        with pytest.raises(ValueError):  # JSONDecodeError: what stopped the worker
            plain._get("celery")
