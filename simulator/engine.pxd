# Types of simulator/engine.py for the compiled core (setup.py builds it with
# Cython; the .py file stays the pure-Python reference).

cimport cython
from roseinfer.scheduler cimport SchedulerOutput

cdef double _INF

@cython.final
cdef class _Roofline:
    cdef public double flops_per_token
    cdef public double flops_per_seq
    cdef public double flops_per_attn_pair
    cdef public double achievable_flops
    cdef public double weight_bytes
    cdef public double kv_bytes_per_token
    cdef public double achievable_bandwidth
    cdef public double overhead_s
    cdef public double comm_s
    cdef public double comm_s_per_token
    cdef public double overhead_per_seq_s
    cdef public double eager_launch_s
    cdef public double imbalance_s_per_token
    cdef public double imbalance_spread_seqs
    cdef public double graph_max_seqs
    cdef public double graph_max_tokens
    cpdef double excess_tokens(self, SchedulerOutput out) except? -1
    @cython.locals(compute_s=double, memory_s=double, comm_s=double, launch_s=double,
                   host_s=double, roof_s=double, imbalance_s=double, spread=double)
    cpdef double step_s(self, double num_tokens, double num_seqs, double attn_pairs,
                        double kv_read_tokens, double num_decodes,
                        double excess_tokens) except? -1

@cython.final
cdef class CostModelBackend:
    cdef public object cost_model
    cdef public bint jump
    cdef public object _run_times_s
    cdef public list _run_ends_s
    cdef public _Roofline _roofline
    cdef public object extrapolation
    cdef public object jitter
    cdef public Py_ssize_t stream
    cdef public Py_ssize_t step_index
    cdef public double _graph_seqs
    cdef public double _graph_tokens
    cpdef Py_ssize_t decode_run_length(self, SchedulerOutput out, double now_s,
                                       double next_arrival_s, Py_ssize_t max_steps) except? -1
    @cython.locals(roofline=_Roofline, num_seqs=double, context=double, num_steps=Py_ssize_t,
                   first_s=double, ends=list, end_s=double, j=Py_ssize_t, step_context=double,
                   excess=double, step_s=double, first_step=Py_ssize_t, eager_run=bint)
    cpdef Py_ssize_t _roofline_run(self, SchedulerOutput out, double now_s,
                                   double next_arrival_s, Py_ssize_t max_steps) except? -1
    @cython.locals(step_s=double, num_decodes=Py_ssize_t, first_step=Py_ssize_t,
                   num_seqs=Py_ssize_t, num_tokens=Py_ssize_t, eager=bint)
    cpdef execute(self, SchedulerOutput out, double now_s)
