# Types of roseinfer/records.py for the compiled core (setup.py builds it with
# Cython; the .py file stays the pure-Python reference).

cimport cython

@cython.final
cdef class StepLog:
    cdef object _end_s
    cdef object _prefill_steps
    cdef Py_ssize_t _base

    @cython.locals(first=Py_ssize_t)
    cpdef append(self, object end_times_s, bint carries_decodes)
    @cython.locals(base=Py_ssize_t, spans=list, num_tokens=Py_ssize_t, first=object, last=object,
                   lo=Py_ssize_t, hi=Py_ssize_t, prefill="long long[:]")
    cpdef tuple _spans(self, object stays)
    @cython.locals(end_s="double[:]", prefill="long long[:]", base=Py_ssize_t,
                   first=Py_ssize_t, last=Py_ssize_t, lo=Py_ssize_t, hi=Py_ssize_t,
                   skip=Py_ssize_t, step=Py_ssize_t)
    cpdef _fill_times(self, list spans, double[:] out, Py_ssize_t pos)

@cython.locals(lo=Py_ssize_t, hi=Py_ssize_t, mid=Py_ssize_t)
cpdef Py_ssize_t _count_upto(long long[:] values, Py_ssize_t x) except -1

@cython.locals(i=Py_ssize_t)
cpdef _diff_in_place(double[:] values, Py_ssize_t start, Py_ssize_t count)
