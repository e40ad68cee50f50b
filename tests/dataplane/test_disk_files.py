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
