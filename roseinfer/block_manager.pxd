# Types of roseinfer/block_manager.py for the compiled core (setup.py builds it
# with Cython; the .py file stays the pure-Python reference). Per-block state
# lives in typed arrays, read through memoryviews here.

cimport cython
from roseinfer.sequence cimport Sequence

cdef Py_ssize_t _PREFIX_KEY_SHIFT

@cython.locals(last=Py_ssize_t, block_keys=list, i=Py_ssize_t, key=Py_ssize_t)
cpdef list _prefix_id_hashes(object hash_ids, Py_ssize_t span, Py_ssize_t block_size,
                             Py_ssize_t num_full)
cpdef bint _small_ids(object hash_ids) except -1

cdef unsigned long long _MASK64, _FMIX1, _FMIX2

@cython.final
cdef class _HashIndex:
    cdef long long[:] slots
    cdef Py_ssize_t mask
    cdef public Py_ssize_t count
    @cython.locals(h="unsigned long long")
    cpdef Py_ssize_t _home(self, long long key) noexcept
    @cython.locals(slot=Py_ssize_t)
    cpdef Py_ssize_t _slot(self, long long key) except -1
    cpdef Py_ssize_t get(self, long long key) except -2
    @cython.locals(slot=Py_ssize_t)
    cpdef Py_ssize_t setdefault(self, long long key, Py_ssize_t block) except -2
    @cython.locals(gap=Py_ssize_t, slot=Py_ssize_t, home=Py_ssize_t)
    cpdef delete(self, long long key)
    @cython.locals(slots="long long[:]", i=Py_ssize_t)
    cpdef list items(self)
    cpdef _rehash(self, Py_ssize_t capacity)

@cython.locals(view="int[:]", i=Py_ssize_t)
cpdef _grown(int[:] values, Py_ssize_t size, Py_ssize_t capacity)

@cython.final
cdef class _PrefixHit:
    cdef public Py_ssize_t epoch
    cdef public list blocks

@cython.final
cdef class BlockManager:
    cdef public object block_hasher
    cdef public Py_ssize_t num_blocks
    cdef public Py_ssize_t block_size
    cdef public bint enable_prefix_caching
    cdef Py_ssize_t _num_touched
    cdef Py_ssize_t _capacity
    cdef int[:] _refs
    cdef list _block_hash
    cdef dict _hash_to_block
    cdef _HashIndex _table
    cdef int[:] _plain
    cdef Py_ssize_t _num_plain
    cdef int[:] _lru_prev
    cdef int[:] _lru_next
    cdef Py_ssize_t _lru_head
    cdef Py_ssize_t _lru_tail
    cdef Py_ssize_t _num_free_cached
    cdef dict _tables
    cdef dict _num_registered
    cdef Py_ssize_t _num_evictions
    cdef public Py_ssize_t num_queried_tokens
    cdef public Py_ssize_t num_hit_tokens
    cdef public object kv_tiers
    cdef public object _tiers
    cdef public list _tier_slots
    cdef public list _observers
    cdef public bint record_transfer_ops
    cdef public object _pending
    cdef public object _last_split
    cdef public Py_ssize_t num_device_hit_tokens
    cdef public double kv_load_s

    cpdef Py_ssize_t _num_free(self) noexcept
    cpdef Py_ssize_t blocks_for(self, Py_ssize_t num_tokens) except? -1
    cpdef list _hashes(self, Sequence seq)
    @cython.locals(hashes=list, max_hit=Py_ssize_t, hits=list, index=dict, i=Py_ssize_t,
                   memo=object, table=_HashIndex, found=Py_ssize_t)
    cpdef list lookup(self, Sequence seq)
    cpdef Py_ssize_t num_cached_tokens(self, Sequence seq) except -1
    @cython.locals(hits=list, refs="int[:]", num_hits=Py_ssize_t, num_hits_free=Py_ssize_t,
                   block=Py_ssize_t, n=Py_ssize_t)
    cpdef bint can_allocate(self, Sequence seq, object num_tokens=*) except -1
    @cython.locals(hits=list, num_hit=Py_ssize_t, n=Py_ssize_t)
    cpdef Py_ssize_t allocate(self, Sequence seq, object num_tokens=*) except -1
    cpdef bint can_grow(self, Sequence seq, Py_ssize_t num_tokens) except -1
    cpdef Py_ssize_t num_blocks_to_grow(self, Sequence seq, Py_ssize_t num_tokens) except -1
    @cython.locals(num_new=Py_ssize_t)
    cpdef grow(self, Sequence seq, Py_ssize_t num_tokens)
    cpdef free(self, Sequence seq)
    @cython.locals(refs="int[:]", plain="int[:]", prev="int[:]", nxt="int[:]", hashes=list,
                   num_plain=Py_ssize_t, tail=Py_ssize_t, num_cached=Py_ssize_t, i=Py_ssize_t,
                   block=Py_ssize_t, left=Py_ssize_t)
    cpdef _release(self, int[:] table)
    cpdef _ref(self, Py_ssize_t block)
    cpdef _lru_push(self, Py_ssize_t block)
    @cython.locals(prev=Py_ssize_t, nxt=Py_ssize_t)
    cpdef _lru_remove(self, Py_ssize_t block)
    @cython.locals(old=Py_ssize_t, capacity=Py_ssize_t, i=Py_ssize_t)
    cpdef _ensure_capacity(self, Py_ssize_t num_touched)
    @cython.locals(ids="int[:]", refs="int[:]", plain="int[:]", num_plain=Py_ssize_t,
                   num_fresh=Py_ssize_t, first=Py_ssize_t, start=Py_ssize_t, i=Py_ssize_t,
                   block=Py_ssize_t)
    cpdef _take(self, Py_ssize_t num_blocks)
    @cython.locals(block=Py_ssize_t)
    cpdef Py_ssize_t _take_one(self) except -1
    @cython.locals(refs="int[:]", nxt="int[:]", end=Py_ssize_t, i=Py_ssize_t, block=Py_ssize_t,
                   hashes=list, index=dict, table=_HashIndex)
    cpdef _evict(self, int[:] taken, Py_ssize_t start)
    @cython.locals(hashes=list, start=Py_ssize_t, end=Py_ssize_t, ids="int[:]", index=dict,
                   block_hash=list, i=Py_ssize_t, block=Py_ssize_t)
    cpdef _register(self, Sequence seq, Py_ssize_t num_tokens)
