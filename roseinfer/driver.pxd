# Types of roseinfer/driver.py for the compiled core (setup.py builds it with
# Cython; the .py file stays the pure-Python reference).

cimport cython
from roseinfer.scheduler cimport Scheduler, SchedulerOutput

@cython.final
cdef class StepResult:
    cdef readonly object end_times_s
    cdef readonly object sampled_token_ids
    cdef readonly object forward_s

@cython.final
cdef class VirtualClock:
    cdef double _now_s
    cpdef double now_s(self) noexcept
    cpdef advance_to(self, double time_s)

@cython.locals(max_steps=Py_ssize_t, until_s=double, num_steps=Py_ssize_t)
cpdef tuple plan_step(Scheduler scheduler, object backend, double now_s, double next_arrival_s=*)
cpdef apply_step(Scheduler scheduler, SchedulerOutput out, double start_s, StepResult result,
                 object on_step=*)
cpdef tuple step_once(Scheduler scheduler, object backend, double now_s,
                      double next_arrival_s=*, object on_step=*)
@cython.locals(i=Py_ssize_t, num_requests=Py_ssize_t, now=double, next_arrival=double)
cpdef drive(Scheduler scheduler, object requests, object backend, object clock, object on_ended,
            object on_step=*, object warn=*)
cpdef _flush(Scheduler scheduler, object on_ended)
