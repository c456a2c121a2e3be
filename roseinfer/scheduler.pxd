# Types of roseinfer/scheduler.py for the compiled core (setup.py builds it with
# Cython; the .py file stays the pure-Python reference). Keep in step with the
# attributes each class sets and the signatures of the methods declared here.

cimport cython
from roseinfer.block_manager cimport BlockManager
from roseinfer.records cimport StepLog
from roseinfer.sequence cimport Sequence

cdef object _PREFILL, _DECODE, _WAITING, _RUNNING, _FINISHED
cdef tuple _PREFILL_ONLY, _DECODE_ONLY

@cython.final
cdef class ScheduledSeq:
    cdef public Sequence seq
    cdef public Py_ssize_t num_computed_tokens
    cdef public Py_ssize_t num_new_tokens
    cdef public bint samples
    cdef public bint is_decode

@cython.final
cdef class SchedulerOutput:
    cdef public Py_ssize_t step_index
    cdef public object phase
    cdef public list decodes
    cdef public list decode_contexts
    cdef public list prefills
    cdef public Py_ssize_t num_steps
    cdef public list preempted
    cdef public Py_ssize_t decode_context_tokens
    cdef public object _items
    cdef public object kv_transfers
    cdef public Py_ssize_t num_prefill_tokens
    cdef public Py_ssize_t prefill_attn_pairs
    cdef public Py_ssize_t prefill_context_tokens
    cdef public Py_ssize_t decode_max_context

    cpdef add_prefill(self, ScheduledSeq item)
    @cython.locals(n=Py_ssize_t, c=Py_ssize_t)
    cpdef _count_prefill(self, ScheduledSeq item, Py_ssize_t sign)
    @cython.locals(i=Py_ssize_t, item=ScheduledSeq, kept=list)
    cpdef remove(self, Sequence seq)

@cython.final
cdef class _StepTokens:
    cdef public double batched
    cdef public double prefill
    cpdef take(self, Py_ssize_t num_tokens, bint prefill)
    cpdef give_back(self, Py_ssize_t num_tokens, bint prefill)
    cpdef double prefill_room(self) noexcept

cdef class Scheduler:
    cdef dict __dict__  # instances take attributes, as before (tests wrap methods so)
    cdef object __weakref__
    cdef public object config
    cdef public object policy
    cdef public object policy_name
    cdef public BlockManager block_manager
    cdef public StepLog step_log
    cdef public object waiting
    cdef public list running
    cdef public list prefilling
    cdef public list decoding
    cdef public Py_ssize_t num_submitted
    cdef public Py_ssize_t num_preemptions
    cdef public Py_ssize_t num_outputs
    cdef public Py_ssize_t max_used_blocks
    cdef public Py_ssize_t _admission_round
    cdef public object _phases
    cdef public object _fixed_order
    cdef public dict _live
    cdef public list _ended
    cdef public bint _acts
    cdef public bint _observes
    cdef public Py_ssize_t _num_admissions
    cdef public Py_ssize_t _num_may_stop
    cdef public Py_ssize_t _block_size
    cdef public Py_ssize_t _max_num_seqs
    cdef public Py_ssize_t _seat_cap
    cdef public double _step_batched
    cdef public double _step_prefill

    cpdef bint has_unfinished(self) except -1
    cpdef list pop_ended(self)
    cpdef SchedulerOutput schedule(self, double now_s)
    @cython.locals(refilled=bint, out=SchedulerOutput, preempted=list)
    cpdef SchedulerOutput _schedule(self, double now_s)
    @cython.locals(has_decodes=bint)
    cpdef tuple _iteration_phases(self, double now_s)
    cpdef Py_ssize_t _free_seats(self) except? -1
    cpdef bint _has_prefill_work(self) except -1
    cpdef Py_ssize_t _cost(self, Sequence seq) except? -1
    @cython.locals(out=SchedulerOutput, room=_StepTokens)
    cpdef SchedulerOutput _plan(self, object phase, double now_s)
    @cython.locals(decodes=list, contexts=list, context=Py_ssize_t, seq=Sequence,
                   num_tokens=Py_ssize_t, longest=Py_ssize_t)
    cpdef _schedule_decodes(self, SchedulerOutput out, _StepTokens room, double now_s)
    @cython.locals(seq=Sequence, chunk=Py_ssize_t, start=Py_ssize_t)
    cpdef _schedule_partial_prefills(self, SchedulerOutput out, _StepTokens room, double now_s)
    cpdef Py_ssize_t _chunk_size(self, Py_ssize_t num_uncomputed, double room) except? -1
    cpdef ScheduledSeq _item(self, Sequence seq, Py_ssize_t start, Py_ssize_t num_new)
    @cython.locals(bm=BlockManager, victim=Sequence)
    cpdef bint _reserve(self, Sequence seq, Py_ssize_t num_tokens, SchedulerOutput out,
                        _StepTokens room, double now_s) except -1
    @cython.locals(item=ScheduledSeq)
    cpdef _unschedule(self, SchedulerOutput out, Sequence victim, _StepTokens room)
    cpdef _leave_running(self, Sequence seq)
    cpdef _preempt(self, Sequence seq)
    @cython.locals(seats=Py_ssize_t)
    cpdef _schedule_admissions(self, SchedulerOutput out, _StepTokens room, double now_s)
    @cython.locals(bm=BlockManager, num_hit=Py_ssize_t, num_cached=Py_ssize_t,
                   num_uncomputed=Py_ssize_t, chunk=Py_ssize_t)
    cpdef _admit(self, Sequence seq, object num_tokens, SchedulerOutput out, _StepTokens room,
                 double now_s)
    @cython.locals(item=ScheduledSeq, completing=Py_ssize_t)
    cpdef bint _may_start_partial(self, SchedulerOutput out) except -1
    @cython.locals(remaining=Py_ssize_t, kept=list, seq=Sequence)
    cpdef _remove_from_waiting(self, set seq_ids)
    cpdef bint _decode_run_possible(self) except -1
    cpdef double quiet_until(self, double now_s) except? -1
    @cython.locals(num_steps=Py_ssize_t, seq=Sequence, left=Py_ssize_t)
    cpdef Py_ssize_t max_decode_run(self, SchedulerOutput out) except? -1
    @cython.locals(decodes=list, contexts=list, bm=BlockManager, block_size=Py_ssize_t,
                   free=Py_ssize_t, extra=Py_ssize_t, need=Py_ssize_t, seq=Sequence,
                   num_tokens=Py_ssize_t, i=Py_ssize_t)
    cpdef extend_decode_run(self, SchedulerOutput out, Py_ssize_t num_steps)
    @cython.locals(k=Py_ssize_t, end_s=double, finished=list, seq=Sequence,
                   num_output=Py_ssize_t, item=ScheduledSeq, bm=BlockManager)
    cpdef list update(self, SchedulerOutput out, object end_times_s,
                      object sampled_token_ids=*)
    @cython.locals(decoding=list)
    cpdef _start_decoding(self, Sequence seq)
    @cython.locals(stay=list, stop=bint)
    cpdef bint _sampled(self, Sequence seq, object token, SchedulerOutput out, double end_s) except -1
    cpdef _finish_running(self, Sequence seq, double end_s, object stop_reason=*)
    cpdef _close_stay(self, Sequence seq)
