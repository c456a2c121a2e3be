# Types of roseinfer/sequence.py for the compiled core (setup.py builds it with
# Cython; the .py file stays the pure-Python reference). Keep in step with the
# attributes Sequence.__init__ sets.

cdef class Sequence:
    cdef public Py_ssize_t seq_id
    cdef public object request
    cdef public object status
    cdef public Py_ssize_t num_output_tokens
    cdef public Py_ssize_t num_computed_tokens
    cdef public object output_token_ids
    cdef public object num_cached_prompt_tokens
    cdef public Py_ssize_t num_preemptions
    cdef public object admitted_s
    cdef public object finish_s
    cdef public object reject_reason
    cdef public list stays
    cdef public object stop_reason
    cdef public bint in_prefill
    cdef public object block_hashes
    cdef public object prefix_hit
    cdef public Py_ssize_t kv_slots
    cdef public Py_ssize_t admission_index
    cdef public Py_ssize_t num_prompt_tokens
    cdef public Py_ssize_t max_output_tokens
