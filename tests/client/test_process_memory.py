"""client.keep_freed_memory: glibc's malloc thresholds, set on request and checked."""

import ctypes.util
import platform

import pytest

from client import keep_freed_memory
from client.process_memory import MAX_MMAP_THRESHOLD


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_takes_both_thresholds():
    assert ctypes.util.find_library("c")
    assert keep_freed_memory() is True
    assert keep_freed_memory(1 << 20, 0) is True  # smaller values are taken as well; calling again is fine
    assert keep_freed_memory() is True


@pytest.mark.parametrize("mmap_threshold,trim_threshold", [(MAX_MMAP_THRESHOLD + 1, 0), (-1, 0), (0, -1)])
def test_out_of_range_values_are_refused_before_the_c_library_sees_them(mmap_threshold, trim_threshold):
    with pytest.raises(ValueError, match="mmap_threshold must be in"):
        keep_freed_memory(mmap_threshold, trim_threshold)
