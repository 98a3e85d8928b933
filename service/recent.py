"""A memory of the most recently put keys, each with a few small ints, all its memory taken up front."""

from __future__ import annotations

from array import array
from collections.abc import Hashable

NIL = -1
ZERO_HASH = 0x5851F42D4C957F2D  # stands for hash() == 0, as 0 marks an empty slot


class Recent:
    """The last `capacity` distinct keys put, least recently put forgotten first, each with `width` ints.

    A key is kept as its 64-bit `hash()` only, so two keys with equal hashes are one key (about
    1e-10 likely at 100k keys). Everything lives in arrays sized at creation, so RSS does not grow
    as it fills (24-32 + 8 * width bytes a key): a table of entry numbers (open addressing, linear
    probing, backward-shift deletion) and per entry its hash, its values and its neighbours in put
    order. The hot paths are inlined by hand: a method call costs as much as a probe.
    """

    __slots__ = ("capacity", "width", "_mask", "_slots", "_keys", "_older", "_newer", "_values",
                 "_len", "_oldest", "_newest")

    def __init__(self, capacity: int, width: int = 0):
        if not 1 <= capacity <= 2**30:
            raise ValueError(f"capacity must be between 1 and 2**30, not {capacity}")
        if width < 0:
            raise ValueError(f"width must be 0 or more, not {width}")
        self.capacity = capacity
        self.width = width
        size = 1 << (2 * capacity - 1).bit_length()  # a power of two >= 2 * capacity
        self._mask = size - 1
        # from bytes rather than of a length: every page is written now, not when first used
        self._slots = array("i", bytes(4 * size))  # entry + 1; 0 = empty
        self._keys = array("q", bytes(8 * capacity))
        self._older = array("i", bytes(4 * capacity))
        self._newer = array("i", bytes(4 * capacity))
        self._values = array("q", bytes(8 * capacity * width))
        self._len = 0
        self._oldest = self._newest = NIL

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (all of it allocated at creation)."""
        return sum(a.itemsize * len(a) for a in (self._slots, self._keys, self._older, self._newer, self._values))

    def __len__(self) -> int:
        return self._len

    def __contains__(self, key: Hashable) -> bool:
        return self._slots[self._slot(hash(key) or ZERO_HASH)] != 0

    def get(self, key: Hashable) -> tuple[int, ...] | None:
        """The values put with `key`, or None when it is not remembered."""
        e = self._slots[self._slot(hash(key) or ZERO_HASH)] - 1
        if e < 0:
            return None
        w = self.width
        return tuple(self._values[e * w:e * w + w])

    def put(self, key: Hashable, *values: int) -> tuple[int, ...] | None:
        """Remember `key` as the newest, with `width` signed 64-bit ints; the values it had, or None."""
        w = self.width
        if len(values) != w:
            raise ValueError(f"put takes {w} values, not {len(values)}")
        h = hash(key) or ZERO_HASH
        i = self._slot(h)
        e = self._slots[i]
        if e:
            e -= 1
            had = (self._values[e],) if w == 1 else tuple(self._values[e * w:e * w + w])
            last = self._newest
            if e != last:  # move to the newest end
                older, newer = self._older, self._newer
                o, n = older[e], newer[e]
                if o == NIL:
                    self._oldest = n
                else:
                    newer[o] = n
                older[n] = o  # n exists: e is not the newest
                older[e] = last
                newer[e] = NIL
                newer[last] = e
                self._newest = e
        else:
            e = self._insert(h, i)
            had = None
        if w == 1:
            self._values[e] = values[0]
        elif w:
            self._values[e * w:e * w + w] = array("q", values)
        return had

    def add(self, key: Hashable) -> bool:
        """Remember `key` unless it is remembered already (then it stays where it is); True when added."""
        h = hash(key) or ZERO_HASH
        i = self._slot(h)
        if self._slots[i]:
            return False
        self._insert(h, i)
        return True

    # ---- internals --------------------------------------------------------------------------
    def _slot(self, h: int) -> int:
        """The slot holding `h`, else the empty slot ending its probe."""
        slots, keys, mask = self._slots, self._keys, self._mask
        i = (h ^ (h >> 32)) & mask
        e = slots[i]
        while e and keys[e - 1] != h:
            i = (i + 1) & mask
            e = slots[i]
        return i

    def _insert(self, h: int, i: int) -> int:
        """Add `h`, absent, whose probe ends at empty slot `i`, as the newest, forgetting the oldest when full."""
        slots, keys, mask, older, newer = self._slots, self._keys, self._mask, self._older, self._newer
        if self._len < self.capacity:
            e = self._len
            self._len += 1
        else:
            e = self._oldest
            self._oldest = n = newer[e]
            if n == NIL:
                self._newest = NIL
            else:
                older[n] = NIL
            gone = keys[e]
            j = (gone ^ (gone >> 32)) & mask
            while slots[j] != e + 1:
                j = (j + 1) & mask
            # backward-shift deletion of slot j: later entries of its run move back into the hole
            k = j
            while True:
                k = (k + 1) & mask
                f = slots[k]
                if not f:
                    break
                g = keys[f - 1]
                if (k - ((g ^ (g >> 32)) & mask)) & mask >= (k - j) & mask:  # the hole is on its probe path
                    slots[j] = f
                    j = k
            slots[j] = 0
            home = (h ^ (h >> 32)) & mask
            if (j - home) & mask < (i - home) & mask:  # the probe for h now ends at the new hole
                i = j
        keys[e] = h
        slots[i] = e + 1
        last = self._newest
        older[e] = last
        newer[e] = NIL
        if last == NIL:
            self._oldest = e
        else:
            newer[last] = e
        self._newest = e
        return e
