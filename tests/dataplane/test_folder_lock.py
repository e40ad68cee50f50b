"""A worker's tier folder is acted on by one authority: a second tier manager over it fails at start,
naming the folder and the holder; closing the first lets the folder be opened again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nexuskv.dataplane.catalog import BackendCatalog
from nexuskv.dataplane.disk import DiskBackend
from nexuskv.dataplane.folder_lock import LOCK_FILE, FolderLock
from nexuskv.dataplane.memory import HostMemoryBackend
from nexuskv.dataplane.tiers import TierManager
from nexuskv.descriptor import Tier
from nexuskv.errors import TierLockedError

from tests.dataplane.tiering import BLOCK_BYTES, Harness, chain_tokens, save_blocks


def _manager(folder, worker: str = "w0") -> TierManager:
    return TierManager(BackendCatalog(worker, [DiskBackend(folder, 8 * BLOCK_BYTES)]))


def test_a_second_manager_on_one_folder_fails_at_start_naming_the_folder_and_the_holder(tmp_path):
    folder = tmp_path / "tiers" / "w0" / "disk"
    first = _manager(folder)
    with pytest.raises(TierLockedError) as err:
        _manager(folder, worker="w0-again")
    message = str(err.value)
    assert str(folder) in message and f"pid {os.getpid()}" in message and "worker w0 " in message
    # The first is untouched: it still acts on its folder.
    assert first.save(save_blocks(chain_tokens(1, 2)), Tier.DISK, tenant="acme").ok
    first.close()
    # Closed, the folder opens again, and the new authority finds what the old one wrote.
    again = _manager(folder, worker="w1")
    try:
        assert len(again.keys(Tier.DISK)) == 2
        assert "worker w1 " in (folder / LOCK_FILE).read_text()
    finally:
        again.close()


def test_the_lock_holds_across_processes_and_ends_with_the_holders_process(tmp_path):
    folder = tmp_path / "disk"
    code = ("import sys, time; from nexuskv.dataplane.folder_lock import FolderLock; "
            f"lock = FolderLock({str(folder)!r}, holder='the other process'); print('held', flush=True); "
            "sys.stdin.readline()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(TierLockedError, match=f"pid {proc.pid}, the other process"):
            _manager(folder)
    finally:
        proc.communicate("\n", timeout=30)
    _manager(folder).close()  # its process ended: the folder is free


def test_memory_tiers_take_no_lock_and_a_failed_start_keeps_none(tmp_path):
    host = HostMemoryBackend(8 * BLOCK_BYTES, pin=False)
    a, b = Harness([host]).manager(), Harness([host]).manager()  # nothing on disk to lock
    a.close(), b.close()
    free, taken = tmp_path / "free", tmp_path / "taken"
    holder = FolderLock(taken, holder="test")
    catalog = BackendCatalog("w0", [DiskBackend(free, BLOCK_BYTES), DiskBackend(taken, BLOCK_BYTES, label="d2")])
    with pytest.raises(TierLockedError):
        TierManager(catalog)
    FolderLock(free, holder="after").release()  # the failed manager let go of the folder it had locked
    holder.release()
    assert not holder.held
