"""The embedded loop store's I/O mode (deltaboxd --loop-io): a real loop-mounted btrfs image,
torn down afterwards."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from deltabox.fs.store import loop_device_of, close_store, open_store

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mkfs.btrfs") is None, reason="needs root and mkfs.btrfs")


@pytest.mark.parametrize("direct", [True, False])
def test_loop_store_takes_the_io_mode_asked_for(tmp_path: Path, direct: bool) -> None:
    store = open_store(tmp_path, 1, direct_io=direct)
    try:
        assert store.backend == "btrfs-loop"
        dev = loop_device_of(tmp_path / "store.img")
        assert dev is not None
        mode = Path(f"/sys/block/{os.path.basename(dev)}/loop/dio").read_text().strip()
        assert mode == ("1" if direct else "0")
        # The store works in that mode: a layer can be made and snapshotted.
        store.new_layer("a")
        store.freeze("a", "b")
        assert set(store.layer_ids()) >= {"a", "b"}
    finally:
        for layer in ("b", "a"):
            store.delete(layer)
        close_store(store)
    assert loop_device_of(tmp_path / "store.img") is None  # detached (autoclear)
