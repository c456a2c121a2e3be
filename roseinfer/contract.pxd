# Types of roseinfer/contract.py for the compiled core (setup.py builds it with
# Cython; the .py file stays the pure-Python reference). The per-choice checks
# are C functions here: an admission round checks each admitted request.

from roseinfer.sequence cimport Sequence

cdef tuple _choice(str where, object choice, set seen, object ctx, object live,
                   bint chunked_prefill)
cdef Sequence _held(object seq, object live, str where, str verb)
