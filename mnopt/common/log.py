"""mnopt's runtime warnings and reports, through ``logging``.

Every warning and report mnopt writes while a job runs is a record on
``logging.getLogger('mnopt')`` or a child named after the module that
says it: a stall (``mnopt.stall``), an overflow on a 16-bit wire
(``mnopt.overflow``), a reduction server refusing a reduction
(``mnopt.server``), a snapshot autoload skipped
(``mnopt.extensions.multi_node_snapshot``), iterators rebuilt for another
number of ranks (``mnopt.iterators.resize``), a launch that failed
(``mnopt.launch``), a rank aborting the job (``mnopt.global_except_hook``),
what a collected communicator left failing to release
(``mnopt.communicators.base``), a process alone in its MPI world
(``mnopt``).  Levels: WARNING where the job goes on, ERROR where it is
aborted or something failed and was ignored.  The message is the text
mnopt writes on stderr (``mnopt: rank 1 has waited 60.0 s in ...``).

In a process that is one rank of several, every line the default
handler writes starts with the rank (``[rank 1] mnopt: ...``), so that
what each rank said can be told apart where ranks share a terminal; a
user's handler gets the message untagged (its format decides).

So a user routes, silences or captures them as any library's::

    logging.getLogger('mnopt').setLevel(logging.ERROR)   # only the errors
    logging.getLogger('mnopt.overflow').setLevel(logging.ERROR)
    logging.getLogger('mnopt').addHandler(my_handler)     # capture
    logging.basicConfig(...)                              # or the root's

The default, with no logging configured, is stderr as before, text for
text.  Python's last-resort handler is not that (it exists only while no
handler at all is configured, so pytest's or any other library's
``basicConfig`` turns it off, and it cannot be told apart from a user's
choice), so this module puts one handler of its own, ``DefaultHandler``,
on the 'mnopt' logger: it writes the bare message (and an exception's
traceback, where a record has one) to the current ``sys.stderr`` and
flushes, but only while the record reaches no other handler: none on its
logger or any ancestor up to the root, following ``propagate`` as
``logging`` does.  A handler the user adds (on 'mnopt', a child, or the
root, ``basicConfig`` included; a ``NullHandler`` to silence) turns it off
for the records that reach it, so nothing is said twice and the user's
formatting wins.  Propagation stays on.  pytest's own capture handlers
(which pytest puts on the root for its reports) do not count: a test
reading stderr sees what a user's job writes.

Records said right before ``MPI_Abort`` (the stall timeout, a rank's
uncaught exception) are followed by ``flush()``, which flushes every
handler they reach (the default handler flushes each record itself).
They go through ``say(..., last_words=True)``: a handler that raises
cannot stop the abort, and where the configuration drops them (a level
above ERROR, loggers disabled by ``dictConfig``) they are written to
stderr all the same, since they are the only word on why the job ended.
The failure summary (with the traceback it holds) goes to stderr also
where the user's handlers send it only elsewhere
(``basicConfig(filename=...)``; ``say(..., on_stderr=True)``), as Python
prints an uncaught exception's traceback on stderr whatever logging is
configured; the user's handlers get it too.

Leaf module: imports only the standard library.
"""

import logging
import sys

#: The root of mnopt's loggers.
ROOT = 'mnopt'


class DefaultHandler(logging.Handler):
    """The bare message on the current ``sys.stderr``, flushed, for the
    records that reach no other handler (see the module's docstring)."""

    def __init__(self):
        super().__init__()
        # The message as mnopt always wrote it: no level, no logger name.
        self.setFormatter(logging.Formatter('%(message)s'))

    def emit(self, record):
        if _other_handlers(record.name, self):
            return
        stream = sys.stderr   # looked up now: tests and users swap it
        if stream is None:    # pythonw: no stderr at all
            return
        try:
            # One write per record, as before: lines of ranks that share
            # a terminal do not interleave mid-line.
            stream.write(tagged(self.format(record)) + '\n')
            stream.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


#: The variables in which launchers give a process its rank and the
#: job's size (MPICH's and Intel MPI's Hydra, Open MPI, PMIx, MVAPICH2,
#: Slurm), for the tag before MPI has started.
RANK_VARIABLES = ('PMI_RANK', 'OMPI_COMM_WORLD_RANK', 'PMIX_RANK',
                  'MV2_COMM_WORLD_RANK', 'SLURM_PROCID')
SIZE_VARIABLES = ('PMI_SIZE', 'OMPI_COMM_WORLD_SIZE', 'MV2_COMM_WORLD_SIZE',
                  'SLURM_NTASKS', 'SLURM_NPROCS')


def job_rank():
    """(rank, size) of this process in its job: MPI's COMM_WORLD where
    MPI runs (never started here), else what the launcher's variables say;
    (None, 1) where nothing says."""
    mpi = sys.modules.get('mpi4py.MPI')
    try:
        if mpi is not None and mpi.Is_initialized() and \
                not mpi.Is_finalized():
            return mpi.COMM_WORLD.rank, mpi.COMM_WORLD.size
    except Exception:
        pass
    import os
    rank = size = None
    for name in RANK_VARIABLES:
        if rank is None and os.environ.get(name, '').isdigit():
            rank = int(os.environ[name])
    for name in SIZE_VARIABLES:
        if size is None and os.environ.get(name, '').isdigit():
            size = int(os.environ[name])
    return rank, size or 1


def rank_name():
    """'rank N' (job_rank's), or 'this process' where nothing says."""
    rank, _ = job_rank()
    return 'this process' if rank is None else 'rank %d' % rank


def tagged(text):
    """``text`` with every line tagged with this process's rank
    (``[rank 1] ``) where it is one of several ranks; else unchanged."""
    rank, size = job_rank()
    if rank is None or size < 2:
        return text
    tag = '[rank %d] ' % rank
    return '\n'.join(tag + line for line in text.split('\n'))


def _pytests(handler):
    """Whether ``handler`` is one of pytest's capture handlers."""
    return type(handler).__module__.startswith('_pytest.')


def _reached_handlers(name, own):
    """The handlers but ``own`` (and pytest's) that a record of logger
    ``name`` reaches, walking up as ``Logger.callHandlers`` does."""
    found = []
    logger = logging.getLogger(name)
    while logger is not None:
        found += [h for h in logger.handlers
                  if h is not own and not _pytests(h)]
        if not logger.propagate:
            break
        logger = logger.parent
    return found


def _writes_to_stderr(handler):
    """Whether ``handler`` writes on this process's stderr."""
    return isinstance(handler, logging.StreamHandler) and \
        getattr(handler, 'stream', None) in (sys.stderr, sys.__stderr__)


def _other_handlers(name, own):
    """Whether a record of logger ``name`` reaches a handler but ``own``
    (and pytest's), walking up as ``Logger.callHandlers`` does."""
    logger = logging.getLogger(name)
    while logger is not None:
        if any(h is not own and not _pytests(h) for h in logger.handlers):
            return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False


def _install():
    root = logging.getLogger(ROOT)
    for h in root.handlers:
        # Once a process, also if this module is imported anew (a reload,
        # or two import paths): one default handler, or lines twice.
        if type(h).__name__ == 'DefaultHandler' and \
                type(h).__module__ == __name__:
            return h
    handler = DefaultHandler()
    root.addHandler(handler)
    return handler


_default_handler = _install()


def get(name=ROOT):
    """The logger ``name`` ('mnopt' or a child: pass a module's
    ``__name__``)."""
    if name != ROOT and not name.startswith(ROOT + '.'):
        raise ValueError('%r is not mnopt\'s logger or a child of it'
                         % (name,))
    return logging.getLogger(name)


def say(logger, level, message, *args, last_words=False, on_stderr=False):
    """``logger.log(level, message, *args)`` that never raises: a user's
    handler that fails must not stop the stall watchdog or an abort (the
    message then goes to stderr).  ``last_words``: said right before the
    job is aborted, so it explains the end: written to stderr also when
    the user's configuration would drop it (a logger disabled by
    ``logging.config.dictConfig``'s ``disable_existing_loggers``, or a
    level above ``level``), since nothing else would say why the job
    died.  ``on_stderr``: written to stderr also where the handlers it
    reaches write elsewhere only (the failure summary)."""
    try:
        dropped = logger.disabled or not logger.isEnabledFor(level)
        if on_stderr and not dropped:
            # Only the user's handlers (a file of theirs) get it: none of
            # them writes to stderr, where the job's end is looked for.
            others = _reached_handlers(logger.name, _default_handler)
            dropped = bool(others) and not any(
                _writes_to_stderr(h) for h in others)
        logger.log(level, message, *args)
    except Exception:
        dropped = True
    if dropped and (last_words or on_stderr):
        try:
            sys.stderr.write(
                tagged(message % args if args else message) + '\n')
            sys.stderr.flush()
        except Exception:
            pass


def flush(name=ROOT):
    """Flush every handler a record of logger ``name`` reaches: before
    the job is aborted, so what was just said is not lost with it."""
    logger = logging.getLogger(name)
    while logger is not None:
        for h in list(logger.handlers):
            try:
                h.flush()
            except Exception:   # a broken handler must not stop the abort
                pass
        if not logger.propagate:
            break
        logger = logger.parent
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
