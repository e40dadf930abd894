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


def test_cacheable_pages_go_idle_and_are_evicted_least_recently_released_first():
    alloc = PageAllocator(4)
    evicted = []
    alloc.on_evict = evicted.append
    pages = alloc.allocate(3)
    for page in pages:
        alloc.mark_cacheable(page)
    alloc.release([2, 0])  # idle: 2 then 0
    assert alloc.free_pages == 3 and alloc.used_pages == 1 and alloc.idle_pages == 2
    assert alloc.idle_order() == [2, 0]
    alloc.release([1])
    assert alloc.idle_order() == [2, 0, 1]
    # Free (never cached) pages go first, then idle ones in release order.
    assert alloc.allocate(2) == [3, 2] and evicted == [2]
    assert not alloc.is_cacheable(2) and alloc.idle_order() == [0, 1]
    # A hit revives an idle page: in use again, never evicted while it is.
    alloc.retain([0])
    assert alloc.ref_count(0) == 1 and alloc.idle_order() == [1]
    with pytest.raises(OutOfPages):
        alloc.allocate(2)
    assert alloc.allocate(1) == [1] and evicted == [2, 1]
    alloc.release([0, 1, 2, 3])
    assert alloc.idle_order() == [0] and alloc.free_pages == 4 and alloc.used_pages == 0


def test_only_pages_in_use_can_be_cached_or_retained():
    alloc = PageAllocator(2)
    with pytest.raises(ValueError, match="not in use"):
        alloc.mark_cacheable(0)
    with pytest.raises(ValueError, match="is free"):
        alloc.retain([0])
    page = alloc.allocate(1)
    alloc.release(page)
    with pytest.raises(ValueError, match="is free"):
        alloc.retain(page)  # not cacheable: back on the free heap, its K/V forgotten
