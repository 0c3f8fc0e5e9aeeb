"""The caching allocator's size rules, written from the spec (PyTorch's CUDACachingAllocator), not
from supermem's code: tests derive every expected size from these.

  every request is rounded up to a multiple of 512 bytes (at least 512);
  rounded sizes <= 1 MiB come from the small pool, which grows by 2 MiB segments;
  larger sizes < 10 MiB share 20 MiB segments; sizes >= 10 MiB get a segment rounded up to 2 MiB;
  passthrough (no caching) gives every block a segment of exactly its rounded size;
  with expandable segments, a stream's segment is address space whose pages (2 MiB) are mapped on
  demand: a fresh allocator maps the rounded size rounded up to whole pages, small or large.
"""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
PiB = 1 << 50
EiB = 1 << 60

MIN_BLOCK = 512
SMALL_MAX = 1 * MiB
SMALL_SEGMENT = 2 * MiB
LARGE_SEGMENT = 20 * MiB
MIN_LARGE_ALLOC = 10 * MiB
LARGE_ROUNDING = 2 * MiB
PAGE = 2 * MiB  # the simulated device's default page, as CUDA's granularity
MAX_REQUEST = EiB  # above this PyTorch says "Tried to allocate more than 1EB memory"


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def rounded(nbytes: int) -> int:
    """Bytes a block of `nbytes` spans."""
    return max(MIN_BLOCK, round_up(nbytes, MIN_BLOCK))


def is_small(nbytes: int) -> bool:
    return rounded(nbytes) <= SMALL_MAX


def segment_bytes(nbytes: int, passthrough: bool = False, expandable: bool = False) -> int:
    """Bytes a fresh allocator reserves (maps) for its first request of `nbytes`."""
    size = rounded(nbytes)
    if passthrough:
        return size
    if expandable:
        return round_up(size, PAGE)
    if size <= SMALL_MAX:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return round_up(size, LARGE_ROUNDING)


# The boundary sizes of the reliability checklist (1 GiB only where the device has room).
BOUNDARY_SIZES = (1, 511, 512, 513, MiB - 1, MiB, MiB + 1, 2 * MiB - 1, 2 * MiB, 2 * MiB + 1, 20 * MiB)
