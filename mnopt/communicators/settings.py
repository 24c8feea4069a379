"""A communicator's settings: which every rank must share, and the ones
read from the environment.

``create_communicator`` checks every setting on every rank before its
first collective, then compares the shared ones in the start-up exchange
(mnopt/transport/agreement.py): a setting that differs is a ValueError on every
rank naming it and each rank's value, not a hang or a truncated message
later.  The others are each rank's own (how long it waits before a stall
report, its BLAS threads, a colocated server's memory, ...).
"""

from mnopt.common import _env
from mnopt.transport import allreduce
from mnopt.transport import collective_check
from mnopt.transport import cpu_phases
from mnopt.transport import waiting
from mnopt.common import _sched
from mnopt.common import cores
from mnopt.timeline import window as timeline_window

#: The settings every rank must share, and why: a mix would hang or
#: corrupt the averaging.  Keyword arguments by name, environment
#: variables as MNOPT_*.  Not here, each rank's own: stall_warning,
#: timeout, batched_copy (no effect on the bits), the reduction server's
#: window (flow control of one worker's pushes), server_memory (a
#: colocated server's staging) and stats, timeline and MNOPT_TIMELINE
#: (each rank writes its own file), MNOPT_BLAS_THREADS,
#: MNOPT_THREAD_SLICE_US, MNOPT_WAIT (how a rank waits: the same bits),
#: MNOPT_LOG_LEVEL (what a rank logs), MNOPT_PROFILE_THREADS (what a rank
#: times) and MNOPT_SINGLE_RANK_AVERAGING (one rank only).
#: Which settings are tuned ('auto') is compared as well (``tuned`` in
#: shared_settings): the window is each rank's own, but a tuning's
#: exchanges hang unless every rank tunes the same settings.
SHARED_SETTINGS = {
    'communicator': 'each kind makes collectives of its own: a mix of '
                    'kinds hangs',
    'allreduce_grad_dtype': 'the wire dtype: ranks sending different '
                            'dtypes send messages of different sizes',
    'bucket_bytes': 'the bytes of each reduction call: different sizes '
                    'truncate messages (MPI aborts the job)',
    'compression': 'a vote of signs on some ranks against a sum on others '
                   'hangs; PowerSGD makes two averagings of other sizes',
    'powersgd_rank': "PowerSGD's factors have this many columns: other "
                     'ranks sum messages of other sizes',
    'min_compression_rate': 'which arrays PowerSGD compresses: a rank '
                            'that compresses others sums other layouts',
    'warm_start': "PowerSGD's Q: the last step's on some ranks against a "
                  'fresh draw on others sums unrelated factors',
    'error_feedback': 'the vote is one vote only if every rank carries (or '
                      'drops) its compression error alike',
    'warmup_steps': 'the averaging at which the votes begin: ranks that '
                    'begin at different ones make different collectives',
    'vote': 'how the votes travel: a ring against an all-to-all hangs',
    'on_overflow': "'ignore' skips the exchange with which 'warn' and "
                   "'error' tell an overflow from an inf that came in",
    'segment_bytes': "the ring's message size: a rank that cuts other "
                     'segments than its neighbour truncates messages',
    'chunk_bytes': 'reduction_server: every worker cuts its shards into '
                   'the same chunks, which the servers check',
    'MNOPT_ALLREDUCE': "the algorithm: mnopt's ring against MPI's "
                       'Allreduce hangs',
    'MNOPT_RANKS_PER_NODE': "which ranks form a node: the node split's "
                            'collectives differ otherwise',
    'MNOPT_TIMELINE_STEPS': 'the steps the timelines record: ranks that '
                            'record other steps leave the report no '
                            'collective to line up',
    'MNOPT_DEBUG': "'detail' makes an exchange before every collective: "
                   'a rank without it would not join that exchange',
}


def environment_settings():
    """Every MNOPT_* setting a communicator reads, checked (ValueError
    naming the variable otherwise): None where it is unset and has no
    default.  Read before the start-up exchange, so that a bad one is an
    error on every rank."""
    return {
        'MNOPT_ALLREDUCE': allreduce.allreduce_algorithm(),
        'MNOPT_RANKS_PER_NODE': _env.whole_number('MNOPT_RANKS_PER_NODE',
                                                  None, 1),
        'MNOPT_SINGLE_RANK_AVERAGING': _env.flag(
            'MNOPT_SINGLE_RANK_AVERAGING', False),
        'MNOPT_BLAS_THREADS': cores.blas_threads_setting(),
        'MNOPT_THREAD_SLICE_US': _sched.slice_us(),
        'MNOPT_WAIT': waiting.kind(),
        'MNOPT_TIMELINE_STEPS': _window(timeline_window.steps_setting()),
        'MNOPT_TIMELINE_MAX_BYTES': timeline_window.max_bytes_setting(),
        'MNOPT_DEBUG': collective_check.mode(),
        'MNOPT_LOG_LEVEL': _env.log_level(),
        'MNOPT_PROFILE_THREADS': cpu_phases.detailed(),
    }


def _window(steps):
    """MNOPT_TIMELINE_STEPS as the exchange compares it ('100:120')."""
    return None if steps is None else timeline_window.describe(steps)


def shared_settings(kind, settings):
    """What every rank must share (SHARED_SETTINGS) of a ``kind``
    communicator's ``settings`` (check_arguments' result), the kind and
    the environment; the start-up exchange compares them.  Unset ones are
    left out.  CommunicatorBase.shared_settings."""
    everything = dict(settings, communicator=kind, **environment_settings())
    shared = {name: everything[name] for name in SHARED_SETTINGS
              if everything.get(name) is not None}
    # compression='auto' is a choice made per gradient set, not a tuned
    # setting (its agreement is the compression setting's own).
    tuned = sorted(name for name, value in settings.items()
                   if isinstance(value, str) and value == 'auto'
                   and name != 'compression')
    if tuned:
        shared['tuned'] = tuned
    return shared
