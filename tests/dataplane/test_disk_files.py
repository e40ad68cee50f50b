"""Reading a disk tier's files from another process's point of view (``stored_header``)."""

import torch

from nexuskv.dataplane.disk import DiskBackend, payload_file, stored_header
from nexuskv.dataplane.payload import PayloadHeader, PayloadKey


def test_stored_header_reads_what_the_owner_wrote(tmp_path):
    owner = DiskBackend(tmp_path, 1 << 20)
    key, other = PayloadKey("sd1-test", 7), PayloadKey("sd1-test", 8)
    data = torch.arange(64, dtype=torch.uint8)
    header = PayloadHeader.for_data(key, data.numpy())
    owner.put(header, data)
    assert payload_file(tmp_path, key) == str(owner.path(key))
    assert stored_header(tmp_path, key) == header
    assert stored_header(tmp_path, other) is None
    path = owner.path(key)
    path.write_bytes(path.read_bytes()[:-1])  # a torn or truncated file is not the payload
    assert stored_header(tmp_path, key) is None
    path.unlink()
    assert stored_header(tmp_path, key) is None


def test_commit_views_writes_a_batch_in_one_call_and_reports_each_failure(tmp_path):
    disk = DiskBackend(tmp_path, 1 << 20)
    keys = [PayloadKey("sd1-test", k) for k in range(5)]
    blocked = PayloadKey("sd1-other", 1)
    (tmp_path / "sd1-other").write_bytes(b"a file where the descriptor's folder would be")
    data = [torch.full((1000,), k, dtype=torch.uint8) for k in range(6)]
    entries = [(PayloadHeader.for_data(k, d.numpy()), d, None) for k, d in zip([*keys[:3], blocked, *keys[3:]], data)]
    entries.append(entries[0])  # the same payload twice in one batch: written once
    out = disk.commit_views(entries)
    assert [type(o).__name__ for o in out] == ["PayloadHandle"] * 3 + ["TierUnavailableError"] + ["PayloadHandle"] * 3
    assert "cannot write" in str(out[3])
    assert sorted(disk.keys()) == keys and disk.used_bytes() == 5 * 1000  # the failed one holds nothing
    for (header, d, _), k in zip([*entries[:3], *entries[4:6]], keys):
        assert stored_header(tmp_path, k) == header
        assert torch.equal(disk.get(k)[1], d)
    assert not [p for p in tmp_path.rglob("*.tmp")]  # no temporary file left behind
    again = DiskBackend(tmp_path, 1 << 20)  # a restart finds every payload written
    assert sorted(again.keys()) == keys


def test_a_native_write_that_fails_is_reported_and_rolled_back(tmp_path):
    import shutil

    disk = DiskBackend(tmp_path, 1 << 20)
    first, second = PayloadKey("sd1-gone", 1), PayloadKey("sd1-gone", 2)
    d = torch.arange(100, dtype=torch.uint8)
    disk.put(PayloadHeader.for_data(first, d.numpy()), d)
    shutil.rmtree(tmp_path / "sd1-gone")  # the folder goes behind the backend's back: its open fails
    out = disk.commit_views([(PayloadHeader.for_data(second, d.numpy()), d, None)])
    assert type(out[0]).__name__ == "TierUnavailableError" and "No such file" in str(out[0])
    assert disk.header(second) is None and disk.used_bytes() == 100  # only the first one is counted
