import pytest

from libkv import OutOfPages, PageAllocator


def test_allocates_lowest_ids_first_and_reuses_freed_pages_in_order():
    alloc = PageAllocator(8)
    assert alloc.allocate(3) == [0, 1, 2]
    assert alloc.allocate(2) == [3, 4]
    alloc.release([1, 0])
    assert alloc.free_pages == 5
    assert alloc.allocate(3) == [0, 1, 5]
    assert alloc.used_pages == 6


def test_out_of_pages_allocates_nothing():
    alloc = PageAllocator(4)
    alloc.allocate(3)
    with pytest.raises(OutOfPages, match="asked for 2 pages, 1 of 4 free"):
        alloc.allocate(2)
    assert alloc.free_pages == 1
    assert alloc.can_allocate(1) and not alloc.can_allocate(2)


def test_reference_counts_keep_shared_pages_until_last_release():
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.retain(pages)
    assert [alloc.ref_count(p) for p in pages] == [2, 2]
    alloc.release(pages)
    assert alloc.free_pages == 2
    alloc.release(pages)
    assert alloc.free_pages == 4


def test_double_release_and_retain_of_free_page_are_errors():
    alloc = PageAllocator(2)
    (page,) = alloc.allocate(1)
    alloc.release([page])
    with pytest.raises(ValueError, match="double release"):
        alloc.release([page])
    with pytest.raises(ValueError, match="is free"):
        alloc.retain([page])
